"""Rollouts of the GRPO step: G responses per prompt from the speculative engine, laid out as
full sequences with their masks and behaviour log-probabilities, then scored.

Rows are prompt-major: the G samples of prompt i are rows i * G .. i * G + G - 1.
Shape letters: see `specjax` (B rows, G group size, P prompt buffer, T max new tokens,
L = P + T, D tree depth).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from specjax.decoding import generate
from specjax.decoding.drafters.eagle3 import Eagle3Weights
from specjax.decoding.drafters.history import HistoryBank
from specjax.decoding.policy import AcceptanceCounts
from specjax.models.params import Params
from specjax.rl.losses import group_advantages
from specjax.rl.state import RewardFn, Rollout, RolloutConfig, TrainConfig


def _assemble(prompts, prompt_lengths, response, response_lengths, logprobs, pad_id):
  """Right-padded prompts `[B, P]` + responses `[B, T]` -> sequences `[B, L]` and masks."""
  b, p = prompts.shape
  l = p + response.shape[1]
  j = jnp.arange(l)[None, :]
  rel = j - prompt_lengths[:, None]
  in_prompt = j < prompt_lengths[:, None]
  in_response = (rel >= 0) & (rel < response_lengths[:, None])
  rel_idx = jnp.clip(rel, 0, response.shape[1] - 1)
  prompt_tok = jnp.take_along_axis(jnp.pad(prompts, ((0, 0), (0, l - p))),
                                   jnp.broadcast_to(j, (b, l)), axis=1)
  tokens = jnp.where(in_prompt, prompt_tok,
                     jnp.where(in_response, jnp.take_along_axis(response, rel_idx, 1), pad_id))
  behaviour = jnp.where(in_response, jnp.take_along_axis(logprobs, rel_idx, 1), 0.0)
  return tokens, in_response.astype(jnp.float32), (in_prompt | in_response).astype(
      jnp.float32), behaviour



def rollout(params: Params, config: TrainConfig, prompts: jax.Array, prompt_lengths: jax.Array,
            key: jax.Array, pad_id: int = 0, drafter_params: Any = None,
            acceptance: AcceptanceCounts | None = None, check_values: bool = True
            ) -> tuple[Rollout, jax.Array, jax.Array, AcceptanceCounts]:
  """Generate G responses per prompt (`prompts [B / G, P]`). Returns the (unscored) rollout,
  the responses `[B, T]`, their lengths `[B]` and the speculation policy's counts at the end.

  Rewards and advantages are left at zero; `score` fills them in. `drafter_params` are the
  drafter's own parameters (an EAGLE-3 head), if it has any; `acceptance`, counts the
  policy starts from (`TrainState.acceptance`), scaled here by the carry
  (`RolloutConfig.carried`). `check_values`: as in `generate` (the train step's batches skip
  it: no host callback inside the step).
  """
  g = config.grpo.group_size
  rc = config.rollout
  prompts = jnp.repeat(prompts, g, axis=0)
  prompt_lengths = jnp.repeat(prompt_lengths, g, axis=0)
  out = generate(params, config.model, prompts, prompt_lengths, key,
                 max_new_tokens=rc.max_new_tokens, sampling=rc.sampling, drafter=rc.drafter,
                 tree=rc.tree, speculation=rc.speculation, eos_id=rc.eos_id, pad_id=pad_id,
                 compaction=rc.compaction,
                 drafter_params=drafter_params,
                 acceptance=rc.carried(acceptance), check_values=check_values)
  tokens, response_mask, valid_mask, behaviour = _assemble(
      prompts, prompt_lengths, out.tokens, out.lengths, out.logprobs, pad_id)
  zeros = jnp.zeros(prompts.shape[:1], jnp.float32)
  roll = Rollout(tokens=tokens, response_mask=response_mask, valid_mask=valid_mask,
                 behaviour_logprobs=behaviour, rewards=zeros, advantages=zeros,
                 lengths=out.lengths, tokens_per_round=out.stats.tokens_per_round,
                 accepted_per_depth=out.stats.accepted_per_depth,
                 plain_share=plain_share(rc, out.stats.tree_rounds),
                 drafter_stats=out.stats.drafter)
  return roll, out.tokens, out.lengths, out.stats.acceptance



def recorded(bank: HistoryBank | None, config: TrainConfig, prompts: jax.Array,
             prompt_lengths: jax.Array, roll: Rollout) -> HistoryBank | None:
  """`bank` after the rollout `roll` of `prompts [B / G, P]` (`prompt_lengths [B / G]`): every
  response recorded (`HistoryBank.record`); None when the run keeps no bank."""
  if bank is None:
    return None
  g = config.grpo.group_size
  starts = jnp.repeat(prompt_lengths, g)[:, None]
  at = starts + jnp.arange(config.rollout.max_new_tokens)[None, :]
  responses = jnp.take_along_axis(roll.tokens, jnp.minimum(at, roll.tokens.shape[1] - 1), 1)
  return bank.record(prompts, prompt_lengths, responses, roll.lengths, g)


def rollout_samples(roll: Rollout, rows: int) -> dict[str, jax.Array]:
  """The first `rows` rows of a rollout as a step returns them for a log: `tokens [rows, L]`
  (prompt, response, padding), `response_mask [rows, L]`, `rewards [rows]`."""
  return {"tokens": roll.tokens[:rows], "response_mask": roll.response_mask[:rows],
          "rewards": roll.rewards[:rows]}



def plain_share(rc: RolloutConfig, tree_rounds: jax.Array) -> jax.Array:
  """The share of a rollout's rounds that decoded plainly, from the rounds each entry of the
  adaptive menu ran (`GenerationStats.tree_rounds`)."""
  if rc.drafter is None:
    return jnp.ones((), jnp.float32)
  if rc.speculation is None:  # a fixed tree drafts every round
    return jnp.zeros((), jnp.float32)
  plain = jnp.asarray([tree.num_nodes == 0 for tree in rc.speculation.menu])
  rounds = tree_rounds.astype(jnp.float32)
  return jnp.where(plain, rounds, 0.0).sum() / jnp.maximum(rounds.sum(), 1.0)



def score(config: TrainConfig, roll: Rollout, rewards: Any) -> Rollout:
  """Attach rewards `[B]` (or a reward's `([B] total, {name: [B]})`) and their group
  advantages."""
  parts = None
  if isinstance(rewards, tuple):
    rewards, parts = rewards
  rewards = jnp.asarray(rewards, jnp.float32)
  adv = group_advantages(rewards, config.grpo.group_size,
                         normalize_std=config.grpo.normalize_std, eps=config.grpo.adv_eps)
  return roll.replace(rewards=rewards, advantages=adv, reward_parts=parts)



def rollout_metrics(config: TrainConfig, roll: Rollout) -> dict[str, jax.Array]:
  n = config.rollout.max_new_tokens
  lengths = roll.lengths.astype(jnp.float32)
  eos = config.rollout.eos_id
  ended = (jnp.zeros(roll.lengths.shape, bool) if eos is None else  # on any of the EOS ids
           jnp.any(jnp.isin(roll.tokens, jnp.asarray(eos)) & (roll.response_mask > 0), axis=1))
  clipped = (roll.lengths >= n) & ~ended
  return {
      "reward_mean": roll.rewards.mean(), "reward_std": roll.rewards.std(),
      "accuracy": (roll.rewards >= config.rollout.success_reward).mean(),
      "response_length_mean": lengths.mean(), "response_length_max": lengths.max(),
      "response_clip_frac": clipped.mean(),
      "acceptance_length": roll.tokens_per_round,
      "accepted_per_depth": roll.accepted_per_depth,
      **({} if roll.plain_share is None else {"plain_share": roll.plain_share}),
      **drafter_metrics(roll.drafter_stats or {}),
      "rollout_tokens": roll.lengths.sum(),
  } | {f"reward_{name}": part.mean() for name, part in (roll.reward_parts or {}).items()}


def drafter_metrics(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """From a drafter's counts (`Drafter.stats`), for each part `<name>` that has
  `<name>_rounds` and `<name>_tokens`: `acceptance_<name>`, the tokens per row-round when it
  drafted (NaN when it never did: a gap in the curves, not a zero), and `drafted_by_<name>`,
  its share of the drafted row-rounds. Tokens are what the target accepted (drafts + its own
  next token) before a row's end cut them, so a part can read a little above
  `acceptance_length`, which counts the tokens emitted."""
  names = [key.removesuffix("_rounds") for key in stats
           if key.endswith("_rounds") and key.removesuffix("_rounds") + "_tokens" in stats]
  total = sum((stats[f"{name}_rounds"] for name in names), jnp.zeros((), jnp.int32))
  out = {}
  for name in names:
    rounds = stats[f"{name}_rounds"].astype(jnp.float32)
    out[f"acceptance_{name}"] = jnp.where(rounds > 0, stats[f"{name}_tokens"] / rounds, jnp.nan)
    out[f"drafted_by_{name}"] = rounds / jnp.maximum(total, 1)
  return out



def scored_rollout(params: Params, drafter_params: Eagle3Weights | None,
                   acceptance: AcceptanceCounts | None, config: TrainConfig, batch,
                   key: jax.Array, reward_fn: RewardFn, pad_id: int = 0
                   ) -> tuple[Rollout, AcceptanceCounts]:
  """Rollout of `batch` (tokens, lengths, answers) by a policy and its drafter, scored by a
  JAX reward; and the speculation policy's counts after it (see `rollout`)."""
  roll, responses, lengths, acceptance = rollout(
      params, config, batch.tokens, batch.lengths, key, pad_id, drafter_params, acceptance,
      check_values=False)
  answers = jnp.repeat(batch.answers, config.grpo.group_size, axis=0)
  return score(config, roll, reward_fn(responses, lengths, answers)), acceptance
