"""Every hot-path program lowers for TPU and for CUDA from this CPU-only machine.

No accelerator has run specjax in CI, so a CPU-only construct on the hot path (a host
callback lowered unconditionally, a CPU custom call) would reach users first. Each program is
traced on abstract inputs (shapes and dtypes only) and lowered with
`lowering_platforms=("tpu",)` and `("cuda",)`: the decode loop with every drafter, fixed and
adaptive trees, sampling and compaction; the fused GRPO step, sync and async, with an
EAGLE-3 head trained online; the sharded step on a 2 x 2 x 2 mesh; both programs of
disaggregated async. A negative control (a drafter that calls back to the host) must fail.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax.decoding import (Adaptive, CostTable, DraftModelDrafter, DraftTree, Eagle3Drafter,
                              Eagle3Weights, MedusaDrafter, MTPDrafter, NGramDrafter,
                              SamplingConfig, generate)
from specjax.models import ModelConfig, init_params
from specjax.models.eagle3 import Eagle3Config, init_eagle3
from specjax.rl import (DisaggregatedAsync, GRPOConfig, RolloutConfig, TrainConfig,
                        init_train_state, make_prime_fn, make_train_step, train_state_shardings)
from specjax.rl.data import PromptBatch
from specjax.rl.distributed import prompt_batch_shardings, sharded_train_step
from specjax.sharding import make_mesh

PLATFORMS = ("tpu", "cuda")
TARGET = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                     mlp_dim=64, num_mtp_modules=2, num_medusa_heads=2, max_position=64)
DRAFT = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=1, n_kv_heads=1,
                    head_dim=16, mlp_dim=32, max_position=64)
EAGLE = Eagle3Config.for_target(TARGET)
B, P, T = 4, 6, 8


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


PARAMS = jax.eval_shape(lambda: init_params(TARGET, jax.random.key(0)))
KEY = jax.eval_shape(lambda: jax.random.key(0))
HEAD = jax.eval_shape(lambda: Eagle3Weights(params=init_eagle3(EAGLE, jax.random.key(0)),
                                            d2t=jnp.zeros((EAGLE.draft_vocab_size,), jnp.int32)))
DRAFTERS = {
    "mtp": (MTPDrafter(), None),
    "medusa": (MedusaDrafter(), None),
    "ngram": (NGramDrafter(), None),
    "draft-model": (DraftModelDrafter(DRAFT),
                    jax.eval_shape(lambda: init_params(DRAFT, jax.random.key(1)))),
    "eagle3": (Eagle3Drafter(EAGLE), HEAD),
}


def lower_everywhere(fn, *args, mesh=None) -> None:
  """`jax.jit(fn)` traced on `args` and lowered for each of `PLATFORMS` (with `mesh` set)."""
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  for platform in PLATFORMS:
    if mesh is None:
      jitted.trace(*args).lower(lowering_platforms=(platform,))
    else:
      with jax.sharding.set_mesh(mesh):
        jitted.trace(*args).lower(lowering_platforms=(platform,))


def decode(drafter, drafter_params, **options):
  def program(params, tokens, lengths, key, drafter_params):
    # check_values stays on: the prompt check is part of what users lower.
    return generate(params, TARGET, tokens, lengths, key, max_new_tokens=T, drafter=drafter,
                    drafter_params=drafter_params, **options)

  lower_everywhere(program, PARAMS, jax.ShapeDtypeStruct((B, P), jnp.int32),
                   jax.ShapeDtypeStruct((B,), jnp.int32), KEY, drafter_params)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_the_decode_loop_lowers_with_every_drafter(name):
  drafter, params = DRAFTERS[name]
  tree = DraftTree.from_widths((2, 1)) if name != "ngram" else DraftTree.chain(2)
  decode(drafter, params, tree=tree, sampling=SamplingConfig(0.7, top_k=8, top_p=0.9))


def test_plain_decoding_greedy_and_compacted_lowers():
  decode(None, None)
  decode(MTPDrafter(), None, tree=DraftTree.chain(2), compaction=2)


def test_the_adaptive_policy_lowers():
  menu = Adaptive.up_to(DraftTree.from_widths((2, 1)))
  costs = CostTable(batches=(2, B), seconds=tuple((0.5 + i, 1.0 + i) for i in range(
      len(menu.menu))))
  decode(MTPDrafter(), None, speculation=menu.with_costs(costs), compaction=1,
         sampling=SamplingConfig(1.0))


def _train_config(drafter, async_mode=False, compaction=0):
  rollout = RolloutConfig(max_new_tokens=T, eos_id=2, sampling=SamplingConfig(1.0),
                          drafter=drafter, tree=DraftTree.chain(2), compaction=compaction)
  return TrainConfig(model=TARGET, grpo=GRPOConfig(group_size=2, num_minibatches=2,
                                                   tis_cap=2.0 if async_mode else None),
                     rollout=rollout, async_mode=async_mode)


def _reward(tokens, lengths, answers):
  return (tokens[:, 0] == answers).astype(jnp.float32)


def _batch():
  return PromptBatch(tokens=jax.ShapeDtypeStruct((B // 2, P), jnp.int32),
                     lengths=jax.ShapeDtypeStruct((B // 2,), jnp.int32),
                     answers=jax.ShapeDtypeStruct((B // 2,), jnp.int32),
                     index=jax.ShapeDtypeStruct((B // 2,), jnp.int32))


def _state(tc, optimizer, head=None, batch=None):
  def make():
    params = init_params(TARGET, jax.random.key(0))
    return init_train_state(tc, params, optimizer, 0, drafter_params=head)
  state = jax.eval_shape(make)
  if tc.async_mode:
    state = jax.eval_shape(make_prime_fn(tc, _reward), state, batch)
  return state


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_the_fused_grpo_step_with_an_online_eagle3_head_lowers(async_mode):
  tc = _train_config(Eagle3Drafter(EAGLE), async_mode, compaction=1)
  optimizer = optax.adam(1e-3)
  head = Eagle3Weights(params=init_eagle3(EAGLE, jax.random.key(0)),
                       d2t=jnp.arange(EAGLE.draft_vocab_size, dtype=jnp.int32))
  state = _state(tc, optimizer, head, _batch())
  lower_everywhere(make_train_step(tc, _reward, optimizer), state, _batch())


def test_the_sharded_step_on_a_2x2x2_mesh_lowers():
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  tc = _train_config(MTPDrafter())
  optimizer = optax.adam(1e-3)
  state = _state(tc, optimizer)
  shardings = train_state_shardings(state, mesh, tc)
  batch = _batch()
  batch_shardings = prompt_batch_shardings(batch, mesh)
  step = sharded_train_step(tc, _reward, optimizer, shardings, batch_shardings)
  lower_everywhere(step.jitted, state, batch, mesh=mesh)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_both_disaggregated_programs_lower():
  devices = jax.devices()
  roll_mesh, train_mesh = make_mesh(data=-1, devices=devices[:2]), make_mesh(data=-1,
                                                                             devices=devices[2:4])
  tc = _train_config(MTPDrafter(), async_mode=True)
  optimizer = optax.adam(1e-3)
  state = init_train_state(tc, init_params(TARGET, jax.random.key(0)), optimizer, 0)
  batch = PromptBatch(tokens=np.full((B // 2, P), 5, np.int32), lengths=np.full(B // 2, P,
                                                                                np.int32),
                      answers=np.zeros(B // 2, np.int32), index=np.arange(B // 2,
                                                                          dtype=np.int32))
  pipeline = DisaggregatedAsync(tc, _reward, optimizer, roll_mesh, train_mesh)
  pipeline.start(state, batch)  # builds (and primes with) both programs, on this CPU
  side, weights = pipeline._side, pipeline._versions[0]
  lower_everywhere(pipeline._rollout.jitted, abstract(weights), abstract(side),
                   abstract(pipeline._on_rollout_mesh(batch)), False, mesh=roll_mesh)
  lower_everywhere(pipeline._update.jitted, abstract(pipeline._train),
                   abstract(pipeline._pending), mesh=train_mesh)


@dataclasses.dataclass(frozen=True)
class _HostDrafter(NGramDrafter):
  """An n-gram drafter whose proposal passes through the host: a CPU-only construct."""

  def propose(self, *args, **kwargs):
    proposal, state = super().propose(*args, **kwargs)
    tokens = jax.pure_callback(lambda t: np.asarray(t), jax.ShapeDtypeStruct(
        proposal.tokens.shape, proposal.tokens.dtype), proposal.tokens)
    return proposal.replace(tokens=tokens), state


def test_negative_control_a_host_callback_on_the_hot_path_does_not_lower():
  with pytest.raises(ValueError, match="different from the lowering platform"):
    decode(_HostDrafter(), None, tree=DraftTree.chain(2))
