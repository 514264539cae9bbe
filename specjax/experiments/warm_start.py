"""The supervised warm start of a built-in policy before RL or before drafting for it."""

from __future__ import annotations

import jax
import numpy as np
import optax
import tqdm

from specjax.experiments.groups import WarmStart
from specjax.models.config import ModelConfig
from specjax.models.params import Params, init_params
from specjax.rl.tasks import Task, task_prompt_ids
from specjax.supervised import init_supervised_state, make_supervised_step


def warm_start_policy(task: Task, model: ModelConfig, recipe: WarmStart, seed: int,
                      log=print, progress: bool = True, params: Params | None = None) -> Params:
  """Supervised training on prompt + answer + EOS: the trunk learns answers (loss on answer
  tokens), the MTP / Medusa heads learn every token. Returns parameters: `params` (e.g. a
  checkpoint's; None: random ones of `model`'s shape) after `recipe.steps` steps.

  A share `1 - recipe.eos_fraction` of the examples continue with another problem instead of
  EOS (see `WarmStart.eos_fraction`). `progress`: a progress bar with the answer CE.
  """
  if params is None:
    params = init_params(model, jax.random.key(seed))
  if not recipe.steps:
    return params
  tok = task.tokenizer
  examples = task.examples("train")
  rng = np.random.default_rng(seed)
  run_on = rng.random(len(examples)) >= recipe.eos_fraction
  nxt = rng.integers(0, len(examples), len(examples))
  seqs = [task_prompt_ids(task, e.prompt) + tok.encode(e.reference)
          + (tok.encode(examples[j].prompt + examples[j].reference) if r else [tok.eos_id])
          for e, r, j in zip(examples, run_on, nxt)]
  prompt_lens = [len(task_prompt_ids(task, e.prompt)) for e in examples]
  width = max(len(s) for s in seqs)
  tokens = np.full((len(seqs), width), tok.pad_id, np.int32)
  answer_mask = np.zeros_like(tokens)
  head_mask = np.zeros_like(tokens)
  for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
    tokens[i, :len(s)] = s
    answer_mask[i, p:len(s)] = 1
    head_mask[i, :len(s)] = 1
  optimizer = optax.adam(recipe.learning_rate)
  state = init_supervised_state(params, optimizer)
  step = make_supervised_step(model, optimizer)
  bar = tqdm.trange(recipe.steps, desc="warm start", disable=not progress, leave=False)
  for i in bar:
    idx = rng.integers(0, len(seqs), recipe.batch)
    state, metrics = step(state, tokens[idx], answer_mask[idx], head_mask[idx])
    if i % 20 == 0 or i == recipe.steps - 1:
      bar.set_postfix(ce=f"{float(metrics['ce']):.3f}")
  log(f"warm start: {recipe.steps} steps, answer ce {float(metrics['ce']):.3f}")
  return state.params
