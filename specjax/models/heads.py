"""Draft heads that live beside the trunk: DeepSeek-V3 MTP modules and Medusa heads.

MTP module k (0-based) at position i reads the previous state `h` (the trunk's normalised
hidden for k = 0, module k-1's output stream otherwise) and the embedding of the token
k + 1 steps ahead, computes `proj [RMSNorm(h); RMSNorm(emb)]`, runs one transformer block
with its own KV cache, and predicts token i + k + 2 through the *shared* output head.

Medusa head k on the trunk's final hidden `h_i` predicts token i + k + 2 with a stack of
residual SiLU blocks followed by the shared output head. No cache.

Shape letters: see `specjax` (B batch, T tokens, E d_model, V vocab).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.params import Params
from specjax.models.transformer import embed, rms_norm, run_blocks, unembed

DRAFT_HEAD_KEYS = ("mtp", "medusa")
"""Top-level parameter keys of the draft heads (present only when the config has them).
The detached drafter loss (`specjax.supervised.draft_head_loss`) reaches only these; the
rest is the trunk, which only the policy loss reaches (the heads are not part of the
policy's forward). RL clips, and reports gradient norms of, the two parts apart."""


@struct.dataclass
class HeadOutput:
  """Result of one MTP module.

  Attributes:
    logits: `[B, T, V]` float32.
    hidden: `[B, T, E]` the module's output residual stream (input state of module k+1).
    cache: the module's cache with the new entries written and committed, or None.
  """

  logits: jax.Array | None
  hidden: jax.Array
  cache: KVCache | None


def mtp_forward(params: Params, config: ModelConfig, module: int, prev_hidden: jax.Array,
                ahead_tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None,
                *, new_mask: jax.Array | None = None,
                advance: jax.Array | int | None = None,
                compute_logits: bool = True) -> HeadOutput:
  """Run MTP module `module` over T positions.

  Args:
    params: full parameters (trunk embedding / output head are shared).
    module: 0-based module index (static).
    prev_hidden: `[B, T, E]` previous state at each position.
    ahead_tokens: `[B, T]` token `module + 1` steps ahead of each position.
    positions: `[B, T]` positions i (RoPE of the module's block).
    cache: optional one-layer `KVCache` of this module.
    new_mask / advance: as in `transformer.forward`.
    compute_logits: skip the output head (logits None); see `mtp_head_logits`.

  Returns:
    `HeadOutput` whose logits at position i predict token i + module + 2.
  """
  if not 0 <= module < config.num_mtp_modules:
    raise ValueError(
        f"module={module} is invalid: config has num_mtp_modules={config.num_mtp_modules}")
  m = params["mtp"][module]
  dt = config.compute_dtype
  h = rms_norm(prev_hidden.astype(dt), m["h_norm"], config.rms_norm_eps)
  e = rms_norm(embed(params, config, ahead_tokens), m["e_norm"], config.rms_norm_eps)
  # X = 2E: [h; emb] concatenated.
  x = jnp.einsum("BTX,XE->BTE", jnp.concatenate([h, e], axis=-1), m["proj"].astype(dt))
  x, _, cache, _ = run_blocks([m["block"]], config, x, positions, cache, new_mask)
  logits = mtp_head_logits(params, config, module, x) if compute_logits else None
  if cache is not None:
    cache = cache.advance(ahead_tokens.shape[1] if advance is None else advance)
  return HeadOutput(logits=logits, hidden=x, cache=cache)


def mtp_head_logits(params: Params, config: ModelConfig, module: int,
                    stream: jax.Array) -> jax.Array:
  """Logits `[..., V]` of MTP module `module` from its output stream `[..., E]`."""
  m = params["mtp"][module]
  return unembed(params, config, rms_norm(stream, m["out_norm"], config.rms_norm_eps))


def mtp_logits_all(params: Params, config: ModelConfig, hidden: jax.Array,
                   tokens: jax.Array, positions: jax.Array) -> list[jax.Array]:
  """Teacher-forced logits of every MTP module over a whole sequence (training).

  Args:
    hidden: `[B, T, E]` the trunk's normalised hidden states for `tokens`.
    tokens: `[B, T]` the sequence.
    positions: `[B, T]`.

  Returns:
    One `[B, T, V]` array per MTP module; entry k at position i predicts `tokens[i + k + 2]`.
    Positions with no such target are computed on padding and must be masked by the loss.
  """
  outs, prev = [], hidden
  for k in range(config.num_mtp_modules):
    ahead = jnp.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1)))
    out = mtp_forward(params, config, k, prev, ahead, positions)
    outs.append(out.logits)
    prev = out.hidden
  return outs


def medusa_logits(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
  """All Medusa heads on normalised hidden `[..., E]` -> `[num_medusa_heads, ..., V]`.

  Head k predicts the token k + 2 steps after the position of `hidden`.
  """
  dt = config.compute_dtype
  outs = []
  for head in params["medusa"]:
    x = hidden.astype(dt)
    for layer in head:
      # w is [E, E]; X is its output axis (= E).
      x = x + jax.nn.silu(jnp.einsum("...E,EX->...X", x, layer["w"].astype(dt))
                          + layer["b"].astype(dt))
    outs.append(unembed(params, config, x))
  return jnp.stack(outs)
