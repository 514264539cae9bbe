"""Checks of what callers pass to `generate` and `DecodeLoop`, before anything is traced or
compiled.

Each error names the argument, the offending entry and what is allowed. Prompt values are
checked with NumPy when concrete; `DecodeLoop.check_prompts` runs the same check as a host
callback when they are traced under a caller's own `jit`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_int
from specjax.decoding.drafters.base import Drafter
from specjax.decoding.policy import Adaptive
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl: str) -> tuple[int, ...]:
  """The shape of one key's raw data under PRNG implementation `impl` (traced once each,
  not per call: tracing costs a `generate` call most of its host time)."""
  return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape


def check_key(key: Any) -> None:
  """Raise `ConfigError` unless `key` is one PRNG key: typed (`jax.random.key(seed)`) or the
  raw uint32 data of `jax.random.PRNGKey(seed)`. Anything else (a seed, None, a batch of
  keys) would fail deep inside the loop's first `jax.random.split`, naming no argument."""
  raw_shape = _raw_key_shape(jax.config.jax_default_prng_impl)
  array = isinstance(key, (jax.Array, np.ndarray))
  if not (array and ((key.shape == () and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key))
                     or (key.shape == raw_shape and key.dtype == np.uint32))):
    got = f"<{key.dtype} array of shape {key.shape}>" if array else repr(key)
    raise ConfigError(f"key={got} is invalid: must be one JAX PRNG key, e.g. "
                      "jax.random.key(0), or the raw key data of jax.random.PRNGKey(0) "
                      f"(uint32 of shape {raw_shape}); not a seed, nor a batch of keys")


def check_prompt_values(prompt_tokens: Any, prompt_lengths: Any, *, vocab_size: int,
                         shortest: int) -> None:
  """Raise `ValueError` naming the first prompt length or id this loop cannot decode from
  (NumPy; also run as a host callback for prompts traced under a caller's `jit`)."""
  tokens, lengths = np.asarray(prompt_tokens), np.asarray(prompt_lengths)
  if tokens.shape[1] < shortest:
    raise ValueError(f"prompt_tokens has width {tokens.shape[1]}: shorter than the shortest "
                     f"prompt this drafter and tree can start from ({shortest} tokens)")
  if lengths.min() < shortest or lengths.max() > tokens.shape[1]:
    raise ValueError(f"prompt_lengths must be in [{shortest}, {tokens.shape[1]}] (the shortest "
                     f"prompt this drafter and tree can start from is {shortest}), got min "
                     f"{lengths.min()} max {lengths.max()}")
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]  # padding is free
  bad = valid & ((tokens < 0) | (tokens >= vocab_size))
  if bad.any():
    row, col = map(int, np.argwhere(bad)[0])
    raise ValueError(f"prompt_tokens[{row}, {col}] = {tokens[row, col]} is not a token id of "
                     f"this model: ids must be in [0, {vocab_size}) ({int(bad.sum())} prompt "
                     "entries are out of range; is the tokenizer's vocabulary larger than the "
                     "model's?)")


def as_ids(x: Any, name: str, ndim: int) -> jax.Array:
  """`x` as int32, refusing what the cast would change: another rank, fractional values or
  ids past int32 (which would wrap to other tokens), and an empty batch."""
  if not isinstance(x, jax.core.Tracer):
    try:
      values = np.asarray(x)
    except ValueError as e:  # NumPy's word for rows of different lengths: "inhomogeneous"
      raise ValueError(f"{name} is ragged ({e}): rows must have one width; right-pad the "
                       "prompts to the longest and pass each row's length in prompt_lengths"
                       ) from None
    if values.ndim != ndim or values.shape[0] == 0:
      raise ValueError(f"{name} has shape {values.shape}: must be "
                       f"{'[batch, prompt_len]' if ndim == 2 else '[batch]'} with batch >= 1")
    if not jnp.issubdtype(values.dtype, jnp.integer):  # jnp: bfloat16 is a float there
      if not (jnp.issubdtype(values.dtype, jnp.floating) and np.all(values == np.round(values))):
        raise ValueError(f"{name} has dtype {values.dtype} with non-integer values: token ids "
                         "and lengths must be integers")
    big = np.abs(values.astype(np.float64)) >= 2**31
    if big.any():
      where = tuple(int(i) for i in np.argwhere(big)[0])
      raise ValueError(f"{name}{list(where)} = {values[where]} does not fit int32: token ids "
                       "and lengths must be in [0, 2**31)")
  elif x.ndim != ndim:
    raise ValueError(f"{name} has shape {x.shape}: must be "
                     f"{'[batch, prompt_len]' if ndim == 2 else '[batch]'}")
  elif not jnp.issubdtype(x.dtype, jnp.integer):  # the cast would truncate, unseen under jit
    raise ValueError(f"{name} is traced with dtype {x.dtype}: token ids and lengths must have "
                     "an integer dtype")
  return jnp.asarray(x, jnp.int32)


def check_loop(loop: Any) -> dict[str, Any]:
  """Raise a `ConfigError` naming the first argument of `DecodeLoop` `loop` that cannot work
  (and what is allowed); return the fields to store as Python ints (NumPy ints and arrays of
  ids are taken)."""
  if not isinstance(loop.config, ModelConfig):
    raise ConfigError(f"config={loop.config!r} is invalid: must be a "
                      "specjax.models.ModelConfig (e.g. config_from_hf(...))")
  if not (is_int(loop.max_new_tokens) and loop.max_new_tokens >= 1):
    raise ConfigError(f"max_new_tokens={loop.max_new_tokens!r} is invalid: must be an int "
                      ">= 1")
  if not (is_int(loop.max_len) and 1 <= loop.max_len <= loop.config.max_position):
    raise ConfigError(f"max_len={loop.max_len!r} is invalid: must be an int in [1, "
                      f"config.max_position={loop.config.max_position}] (the cache slots)")
  if not isinstance(loop.sampling, SamplingConfig):
    raise ConfigError(f"sampling={loop.sampling!r} is invalid: must be a "
                      "specjax.decoding.SamplingConfig (e.g. SamplingConfig(temperature=0.7))")
  if not isinstance(loop.tree, DraftTree):
    raise ConfigError(f"tree={loop.tree!r} is invalid: must be a specjax.decoding.DraftTree")
  if loop.speculation is not None:
    if not isinstance(loop.speculation, Adaptive):
      raise ConfigError(f"speculation={loop.speculation!r} is invalid: must be "
                        "specjax.decoding.Adaptive(menu=...) or None")
    if loop.tree.num_nodes:
      raise ConfigError("pass either tree=... (a fixed tree) or speculation=Adaptive(menu) "
                        "(a tree chosen per round), not both")
    if loop.drafter is None:
      raise ConfigError("speculation=Adaptive(...) needs a drafter: pass drafter=...")
  if not (is_int(loop.compaction) and loop.compaction >= 0):
    raise ConfigError(f"compaction={loop.compaction!r} is invalid: must be an int >= 0 "
                      "(halvings of the batch)")
  # Python ints: the loop is jit's static argument, hashed, and its fields go to JSON
  fields = {f: int(getattr(loop, f)) for f in ("max_new_tokens", "max_len", "compaction")}
  if not callable(loop.verifier):
    raise ConfigError(f"verifier={loop.verifier!r} is invalid: must be a "
                      "specjax.decoding.Verifier, e.g. LosslessVerifier()")
  if loop.max_nodes and loop.drafter is None:
    raise ConfigError("a draft tree needs a drafter: pass drafter=... or tree=None")
  if loop.drafter is not None and not isinstance(loop.drafter, Drafter):
    raise ConfigError(f"drafter={loop.drafter!r} is invalid: must be a "
                      "specjax.decoding.Drafter (MTPDrafter(), NGramDrafter(), ...)")
  if loop.drafter is not None:
    if not isinstance(loop.drafter.sampled, (bool, np.bool_)):
      raise ConfigError(f"{type(loop.drafter).__name__}(sampled={loop.drafter.sampled!r}) is "
                        "invalid: must be True (sampled drafts) or False")
    for tree in loop.menu:
      loop.drafter.validate(loop.config, tree)
  vocab = loop.config.vocab_size
  widest = max(t.max_children for t in loop.menu)
  if widest > vocab:
    raise ConfigError(f"a draft tree whose node has {widest} children is invalid for a "
                      f"vocabulary of {vocab} tokens: the children of a node are distinct "
                      "tokens")
  if loop.eos_id is not None:
    eos = loop.eos_id
    if isinstance(eos, (np.ndarray, jax.Array)) and not isinstance(eos, jax.core.Tracer):
      eos = np.asarray(eos)  # an array of ids: its entries, or its one entry
      eos = eos.tolist() if eos.ndim == 1 else eos.item() if eos.ndim == 0 else eos
    many = isinstance(eos, (list, tuple))
    ids = tuple(eos) if many else (eos,)
    bad = [i for i in ids if not is_int(i) or not 0 <= i < vocab]
    if bad or not ids:
      raise ConfigError(f"eos_id={loop.eos_id!r} is invalid"
                        + (f" ({', '.join(map(repr, bad))} not a token id)" if bad else "")
                        + f": must be None, a token id in [0, {vocab}) or a non-empty "
                        "sequence of them")
    fields["eos_id"] = tuple(int(i) for i in ids) if many else int(ids[0])
  if not (is_int(loop.pad_id) and -2**31 <= loop.pad_id < 2**31):
    raise ConfigError(f"pad_id={loop.pad_id!r} is invalid: must be an int that fits int32 "
                      "(the filler of the returned tokens after each row's end)")
  fields["pad_id"] = int(loop.pad_id)
  return fields


# The lowering platforms of each backend `jax.default_backend()` names.
_PLATFORMS = {"gpu": ("cuda", "rocm")}


def host_check(check: Callable[..., None], *args: jax.Array) -> None:
  """`check(*args)` on the host when the traced program runs (`jax.debug.callback`; a raise
  fails the call).

  The callback is part of the program lowered for this process's backend (CPU, GPU or TPU,
  whichever runs it) and left out of a program lowered for another platform, as when a TPU
  or GPU program is compiled ahead of time on a CPU host (`.lower(lowering_platforms=...)`):
  a host callback cannot be lowered for a platform other than the one it would call back
  from, and such a program does not run here. Check those inputs before the call.
  """
  def call(*values):
    jax.debug.callback(check, *values)
    return ()

  backend = jax.default_backend()
  jax.lax.platform_dependent(*args, **{p: call for p in _PLATFORMS.get(backend, (backend,))},
                             default=lambda *values: ())
