"""Models and data of `spec_decode.py`: a procedural phrase language, a >= 25M-parameter
target with MTP modules and Medusa heads, a small draft model, an EAGLE-3 head, their training
and a disk cache.

The language ("phrase Markov language"): a fixed set of phrases, each a short template of
words from the vocabulary; a document is a chain of phrases in which each phrase is followed
by one of a few successor phrases with skewed probabilities. Some template positions are
*slots* filled at random (a number, or a name drawn from a Zipf law). So the next token is
often determined by the context (inside a phrase), sometimes a skewed choice (the first word
of the next phrase), and sometimes nearly unpredictable (a slot) — at temperature 1 the target
is neither deterministic nor uniform, and acceptance rates mean something. The generator
knows the process entropy of every token it writes, which the benchmark prints next to the
target's cross-entropy.

Glossary: B batch, T tokens, V vocab, W draft vocab (EAGLE-3), J training-time-test steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.decoding import Eagle3Weights, SamplingConfig, generate
from specjax.supervised.eagle3 import (draft_vocab_from_data, eagle3_loss,
                                      self_distillation_data, train_eagle3)
from specjax.models import Eagle3Config, ModelConfig, count_params, init_eagle3, init_params
from specjax.supervised import init_supervised_state, make_supervised_step

Params = dict[str, Any]

PAD, BOS = 0, 1

# ------------------------------------------------------------------------------- language


@dataclasses.dataclass(frozen=True)
class LanguageSpec:
  """Shape of the phrase language (everything is drawn from `seed`)."""

  vocab_size: int = 2048
  num_phrases: int = 96
  min_len: int = 2
  max_len: int = 7
  successors: int = 4          # successor phrases per phrase
  dirichlet: float = 0.5       # skew of the successor probabilities (smaller = more skewed)
  slot_rate: float = 0.12      # fraction of template positions that are random slots
  numbers: int = 100           # slot values of kind "number" (uniform)
  names: int = 60              # slot values of kind "name" (Zipf)
  seed: int = 1234


class PhraseLanguage:
  """Sampler of documents of the phrase language (NumPy, host side)."""

  def __init__(self, spec: LanguageSpec):
    self.spec = spec
    rng = np.random.default_rng(spec.seed)
    self.num_lo = 2
    self.name_lo = self.num_lo + spec.numbers
    self.word_lo = self.name_lo + spec.names
    words = spec.vocab_size - self.word_lo
    zipf = 1.0 / np.arange(1, spec.names + 1)
    self.name_p = zipf / zipf.sum()
    # Template words follow a mild Zipf law, so common words are shared between phrases and
    # a phrase is identified by more than its current word.
    word_p = 1.0 / np.arange(1, words + 1) ** 0.6
    word_p /= word_p.sum()
    self.templates: list[np.ndarray] = []  # >= 0: word id; -1: number slot; -2: name slot
    for _ in range(spec.num_phrases):
      n = int(rng.integers(spec.min_len, spec.max_len + 1))
      t = self.word_lo + rng.choice(words, n, p=word_p)
      slot = rng.random(n) < spec.slot_rate
      slot[0] = False  # a phrase starts with a word, so a boundary is a skewed choice
      t = np.where(slot, np.where(rng.random(n) < 0.5, -1, -2), t)
      self.templates.append(t.astype(np.int64))
    self.next_phrase = np.stack([rng.choice(spec.num_phrases, spec.successors, replace=False)
                                 for _ in range(spec.num_phrases)])
    self.next_p = rng.dirichlet(np.full(spec.successors, spec.dirichlet), spec.num_phrases)
    # Entropy of the next phrase's first word given the current phrase (first words can
    # collide, which merges probability).
    self.boundary_entropy = np.zeros(spec.num_phrases)
    for i in range(spec.num_phrases):
      mass: dict[int, float] = {}
      for j, q in zip(self.next_phrase[i], self.next_p[i]):
        w = int(self.templates[j][0])
        mass[w] = mass.get(w, 0.0) + q
      q = np.array(list(mass.values()))
      self.boundary_entropy[i] = -(q * np.log(np.maximum(q, 1e-30))).sum()
    self.number_entropy = float(np.log(spec.numbers))
    self.name_entropy = float(-(self.name_p * np.log(self.name_p)).sum())

  def document(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
    """`length` tokens starting with BOS, and the process entropy (nats) of each token."""
    toks, ent = [BOS], [0.0]
    phrase = int(rng.integers(self.spec.num_phrases))
    first_entropy = float(np.log(self.spec.num_phrases))
    while len(toks) < length:
      for pos, t in enumerate(self.templates[phrase]):
        if t == -1:
          toks.append(self.num_lo + int(rng.integers(self.spec.numbers)))
          ent.append(self.number_entropy)
        elif t == -2:
          toks.append(self.name_lo + int(rng.choice(self.spec.names, p=self.name_p)))
          ent.append(self.name_entropy)
        else:
          toks.append(int(t))
          ent.append(first_entropy if pos == 0 else 0.0)
      first_entropy = float(self.boundary_entropy[phrase])
      phrase = int(self.next_phrase[phrase][rng.choice(self.spec.successors,
                                                       p=self.next_p[phrase])])
    return np.array(toks[:length], np.int32), np.array(ent[:length], np.float32)

  def batch(self, rng: np.random.Generator, batch: int, length: int) -> tuple[np.ndarray,
                                                                                np.ndarray]:
    docs = [self.document(rng, length) for _ in range(batch)]
    return np.stack([d[0] for d in docs]), np.stack([d[1] for d in docs])

  def token_ids(self) -> np.ndarray:
    """The ids the language can write after BOS: numbers, names and template words."""
    words = np.concatenate([t[t >= 0] for t in self.templates])
    return np.union1d(np.arange(self.num_lo, self.word_lo), words)


# --------------------------------------------------------------------------------- models

# Target: Llama-style GQA decoder in float32 whose trunk alone has >= 25M parameters, with 3
# MTP modules and 3 Medusa heads. Draft: a 2-layer model sharing the vocabulary.
TARGET = ModelConfig(vocab_size=2048, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                     head_dim=64, mlp_dim=1536, num_mtp_modules=3, num_medusa_heads=3,
                     max_position=512)
DRAFT = ModelConfig(vocab_size=2048, d_model=256, n_layers=2, n_heads=4, n_kv_heads=1,
                    head_dim=64, mlp_dim=768, max_position=512)


# EAGLE-3 head: one decoder layer on the target's streams at aux ids (2, 4, 5) (the default
# for an 8-layer target), over a reduced draft vocabulary. The language writes 461 distinct
# tokens (100 numbers, 60 names, 301 template words), so W = 512 has room for all of them
# plus the target's most frequent off-language samples (built from EagleSpec's 224 training
# responses it covers 99.95% of held-out sampled tokens), and the head costs 512 x 512
# instead of 512 x 2048 (a quarter of the full vocabulary). Its MLP is a third of a target
# layer's (512 vs 1536): a full-width midlayer is 1/8 of this 8-layer target, so three draft
# passes would cost ~0.4 plain steps, where at 8B (32 layers) the same head costs ~0.1; the
# narrower MLP keeps drafting at the share of a step the head has at scale.
EAGLE3 = Eagle3Config.for_target(TARGET, draft_vocab_size=512, mlp_dim=512)


def param_counts(params: Params) -> dict[str, int]:
  """Parameter counts: trunk (what a decode step reads), MTP modules, Medusa heads, total."""
  trunk = {k: v for k, v in params.items() if k not in ("mtp", "medusa")}
  return {"trunk": count_params(trunk), "mtp": count_params(params.get("mtp", [])),
          "medusa": count_params(params.get("medusa", [])), "total": count_params(params)}


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """Training schedule (fixed step counts, so a cache key identifies the result)."""

  batch: int = 4
  length: int = 128
  target_steps: int = 200
  target_lr: float = 2e-3
  draft_steps: int = 250
  draft_lr: float = 3e-3
  # Phase 2: the drafters (MTP / Medusa with the trunk frozen, and the draft model) are
  # trained on the target's own temperature-1 samples, so they match the distribution they
  # are verified against.
  distill_docs: int = 128
  distill_prompt: int = 8
  distill_target_steps: int = 50
  distill_draft_steps: int = 100
  seed: int = 0


# --quick without a cache: a short schedule, only to smoke-test the pipeline.
QUICK_TRAIN = TrainSpec(target_steps=20, draft_steps=30, distill_docs=64,
                        distill_target_steps=10, distill_draft_steps=10)


@dataclasses.dataclass(frozen=True)
class EagleSpec:
  """EAGLE-3 training schedule (`specjax.supervised.eagle3`), after the target's.

  The head learns on the target's own temperature-1 responses (`self_distillation_data`) to
  `docs` language prompts of `prompt` tokens, with the training-time test over `ttt_steps`
  draft steps and the target's distributions as soft labels; the last `held_out` responses
  are kept out of training to measure it.
  """

  docs: int = 256
  held_out: int = 32
  prompt: int = 8
  length: int = 128
  # ~0.5 s a step on 2 quiet cores, so ~3 min. Measured on held-out responses (KL to the
  # target per TTT step = CE - the target's entropy, 0.66): batch 4 x 360 steps at lr 3e-3
  # reached 0.09 / 0.10 / 0.11; batch 8 x 180 (same tokens) ~0.10 / 0.11 / 0.13, with lr
  # 6e-3 0.13 / 0.14 / 0.15; batch 8 x 250 (1.4x the time) 0.08 / 0.09 / 0.10.
  batch: int = 4
  steps: int = 360
  lr: float = 3e-3
  ttt_steps: int = 3
  step_decay: float = 1.0
  seed: int = 0


# --quick without a cached head: a short schedule, only to smoke-test the pipeline.
QUICK_EAGLE = EagleSpec(docs=48, held_out=16, batch=4, steps=20)


def _init(config: ModelConfig, key: jax.Array) -> Params:
  """`init_params`, with the residual-branch output projections (wo, w_down) at zero.

  With std-0.02 projections, 8 random blocks bury the embedding under noise and the trunk
  sits on a loss plateau for ~50 steps; zero-initialised projections (as in modded-nanogpt)
  start from the clean embedding -> unembedding path and learn from the first step.
  """
  params = init_params(config, key)
  blocks = list(params["layers"]) + [m["block"] for m in params.get("mtp", [])]
  for blk in blocks:
    blk["wo"] = jnp.zeros_like(blk["wo"])
    blk["w_down"] = jnp.zeros_like(blk["w_down"])
  return params


def _optimizer(lr: float, steps: int, trainable=None) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(20, steps // 5 + 1), steps,
                                                lr * 0.1)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98,
                                                                weight_decay=0.0))
  if trainable is None:
    return opt
  return optax.multi_transform({"train": opt, "freeze": optax.set_to_zero()}, trainable)


def _train(config: ModelConfig, params: Params, optimizer, docs_fn, steps: int, *,
           detach_heads: bool = False, log=print, name: str = "") -> tuple[Params, dict]:
  state = init_supervised_state(params, optimizer)
  step = make_supervised_step(config, optimizer, mtp_weight=0.5, medusa_weight=0.5,
                              detach_heads=detach_heads)
  metrics = {}
  t0 = time.perf_counter()
  for i in range(steps):
    tokens = docs_fn(i)
    state, metrics = step(state, tokens, np.ones_like(tokens))
    if (i + 1) % 50 == 0 or i + 1 == steps:
      m = jax.device_get(metrics)
      extra = ""
      if "mtp_ce" in m:
        extra += " mtp_ce " + " ".join(f"{x:.2f}" for x in m["mtp_ce"])
      if "medusa_ce" in m:
        extra += " medusa_ce " + " ".join(f"{x:.2f}" for x in m["medusa_ce"])
      log(f"  {name} step {i + 1}/{steps} ({time.perf_counter() - t0:.0f}s): "
          f"ce {m['ce']:.3f} acc {m['accuracy']:.3f}{extra}")
  return state.params, jax.device_get(metrics)


def _head_labels(params: Params) -> Params:
  """'train' on MTP / Medusa leaves, 'freeze' on the trunk (for phase 2)."""
  return {k: jax.tree.map(lambda _: "train" if k in ("mtp", "medusa") else "freeze", v)
          for k, v in params.items()}


def _sample_target(params: Params, lang: PhraseLanguage, spec: TrainSpec) -> np.ndarray:
  """`[distill_docs, length]` documents whose continuations the target sampled at T=1."""
  rng = np.random.default_rng(spec.seed + 2)
  prompts, _ = lang.batch(rng, spec.distill_docs, spec.distill_prompt)
  out = []
  for lo in range(0, spec.distill_docs, 64):
    p = jnp.asarray(prompts[lo:lo + 64])
    res = generate(params, TARGET, p, jnp.full((p.shape[0],), p.shape[1]),
                   jax.random.key(spec.seed + lo), max_new_tokens=spec.length - p.shape[1],
                   sampling=SamplingConfig(1.0))
    out.append(np.concatenate([prompts[lo:lo + 64], np.asarray(res.tokens)], 1))
  return np.concatenate(out).astype(np.int32)


def train_models(lang: PhraseLanguage, spec: TrainSpec, log=print) -> tuple[Params, Params,
                                                                             dict]:
  """Train target (trunk + MTP + Medusa jointly), draft model, then distill the drafters."""
  info: dict[str, Any] = {}
  t0 = time.perf_counter()
  rng = np.random.default_rng(spec.seed)
  data = lambda i: lang.batch(rng, spec.batch, spec.length)[0]
  target, m = _train(TARGET, _init(TARGET, jax.random.key(spec.seed)),
                     _optimizer(spec.target_lr, spec.target_steps), data, spec.target_steps,
                     log=log, name="target")
  info["target_phase1_s"] = time.perf_counter() - t0
  t1 = time.perf_counter()
  draft, _ = _train(DRAFT, _init(DRAFT, jax.random.key(spec.seed + 1)),
                    _optimizer(spec.draft_lr, spec.draft_steps), data, spec.draft_steps,
                    log=log, name="draft")
  info["draft_phase1_s"] = time.perf_counter() - t1
  t2 = time.perf_counter()
  samples = _sample_target(target, lang, spec)
  info["sample_s"] = time.perf_counter() - t2
  srng = np.random.default_rng(spec.seed + 3)
  pick = lambda i: samples[srng.choice(len(samples), spec.batch, replace=False)]
  t3 = time.perf_counter()
  target, _ = _train(TARGET, target, _optimizer(spec.target_lr / 2, spec.distill_target_steps,
                                                _head_labels(target)),
                     pick, spec.distill_target_steps, detach_heads=True, log=log,
                     name="heads (distill)")
  draft, _ = _train(DRAFT, draft, _optimizer(spec.draft_lr / 2, spec.distill_draft_steps),
                    pick, spec.distill_draft_steps, log=log, name="draft (distill)")
  info["distill_s"] = time.perf_counter() - t3
  info["train_s"] = time.perf_counter() - t0
  return target, draft, info


def train_eagle3_head(target: Params, lang: PhraseLanguage, spec: EagleSpec,
                      log=print) -> tuple[Eagle3Weights, dict]:
  """An `EAGLE3` head distilled from the (trained, frozen) `target` on its own samples."""
  info: dict[str, Any] = {}
  t0 = time.perf_counter()
  rng = np.random.default_rng(spec.seed + 20)
  prompts, _ = lang.batch(rng, spec.docs, spec.prompt)
  tokens, mask = self_distillation_data(
      target, TARGET, prompts, np.full(spec.docs, spec.prompt, np.int32),
      jax.random.key(spec.seed + 21), max_new_tokens=spec.length - spec.prompt,
      sampling=SamplingConfig(1.0))
  info["sample_s"] = time.perf_counter() - t0
  n = spec.docs - spec.held_out
  train_tokens, train_mask = tokens[:n], mask[:n]
  d2t = draft_vocab_from_data(train_tokens, train_mask, TARGET.vocab_size,
                              EAGLE3.draft_vocab_size)
  # Token mass the draft vocabulary covers: a sampled draft can only propose these ids, so
  # the target's mass outside them is lost to acceptance.
  for name, t, m in (("train", train_tokens, train_mask), ("held_out", tokens[n:], mask[n:])):
    ids = t[m > 0]
    info[f"vocab_coverage_{name}"] = float(np.isin(ids, d2t).mean())
  language = lang.token_ids()
  info["vocab_language_tokens"] = f"{np.isin(language, d2t).sum()}/{len(language)}"
  log(f"  eagle3 draft vocabulary W={EAGLE3.draft_vocab_size}: covers "
      f"{100 * info['vocab_coverage_train']:.2f}% of the sampled training tokens, "
      f"{100 * info['vocab_coverage_held_out']:.2f}% held out, "
      f"{info['vocab_language_tokens']} of the language's tokens")

  brng = np.random.default_rng(spec.seed + 22)

  def batches():
    for _ in range(spec.steps):
      rows = brng.choice(n, spec.batch, replace=False)
      yield train_tokens[rows], train_mask[rows]

  t1 = time.perf_counter()

  def progress(step: int, m: dict) -> None:
    if step % 50 == 0 or step == spec.steps:
      log(f"  eagle3 step {step}/{spec.steps} ({time.perf_counter() - t1:.0f}s): loss "
          f"{m['loss']:.3f} ce {' '.join(f'{x:.2f}' for x in m['ce'])} acc "
          f"{' '.join(f'{x:.3f}' for x in m['accuracy'])}")

  weights, history = train_eagle3(
      target, TARGET, EAGLE3, batches(), optimizer=_optimizer(spec.lr, spec.steps), d2t=d2t,
      key=jax.random.key(spec.seed + 23), ttt_steps=spec.ttt_steps,
      step_decay=spec.step_decay, callback=progress)
  info["train_s"] = time.perf_counter() - t1
  # Per-step accuracy (draft top-1 == the target's argmax) of the training batches at the
  # end, and on the held-out responses.
  tail = history[-max(1, spec.steps // 10):]
  info["train_accuracy"] = [float(np.mean([h["accuracy"][j] for h in tail]))
                            for j in range(spec.ttt_steps)]
  evaluate = jax.jit(lambda p, tp, d, t, m: eagle3_loss(
      p, EAGLE3, tp, TARGET, d, t, m, ttt_steps=spec.ttt_steps, step_decay=spec.step_decay)[1])
  metrics = jax.device_get(evaluate(weights.params, target, weights.d2t,
                                    jnp.asarray(tokens[n:]), jnp.asarray(mask[n:])))
  info["held_out_accuracy"] = [float(x) for x in metrics["accuracy"]]
  info["held_out_ce"] = [float(x) for x in metrics["ce"]]
  info["total_s"] = time.perf_counter() - t0
  log(f"  eagle3 trained in {info['train_s']:.0f}s (+{info['sample_s']:.0f}s sampling): "
      f"per-step TTT accuracy, training batches "
      f"{' '.join(f'{x:.3f}' for x in info['train_accuracy'])}, held out "
      f"{' '.join(f'{x:.3f}' for x in info['held_out_accuracy'])}")
  return weights, info


# ---------------------------------------------------------------------------------- cache


# ModelConfig fields that choose how a model runs, not what it computes: a trained model
# cached before they existed (or under other values) is still the same model.
_RUNTIME_FIELDS = frozenset({"attention_impl", "attention_block"})


def _key(*objs) -> str:
  def fields(o):
    if not dataclasses.is_dataclass(o):
      return o
    return {k: v for k, v in dataclasses.asdict(o).items() if k not in _RUNTIME_FIELDS}

  text = json.dumps([fields(o) for o in objs], sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def _save(path: Path, params: Params) -> None:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})


def _load(path: Path, like: Params) -> Params:
  with np.load(path) as f:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(f[jax.tree_util.keystr(k)]) for k, _ in leaves])


def _paths(cache_dir: Path, lang_spec: LanguageSpec, spec: TrainSpec) -> tuple[Path, ...]:
  key = _key(TARGET, DRAFT, lang_spec, spec, "v1")
  return (cache_dir / f"target-{key}.npz", cache_dir / f"draft-{key}.npz",
          cache_dir / f"info-{key}.json")


def is_cached(cache_dir: Path, lang_spec: LanguageSpec, spec: TrainSpec) -> bool:
  return all(p.exists() for p in _paths(cache_dir, lang_spec, spec))


def load_or_train(cache_dir: Path, lang_spec: LanguageSpec, spec: TrainSpec, *,
                  retrain: bool = False, log=print) -> tuple[Params, Params, dict]:
  """Trained (target, draft) params from `cache_dir`, training and caching them if absent."""
  cache_dir.mkdir(parents=True, exist_ok=True)
  # The cache directory ignores itself, so nothing it holds can be added to git.
  (cache_dir / ".gitignore").write_text("*\n")
  t_path, d_path, i_path = _paths(cache_dir, lang_spec, spec)
  if not retrain and is_cached(cache_dir, lang_spec, spec):
    target = _load(t_path, jax.eval_shape(lambda: init_params(TARGET, jax.random.key(0))))
    draft = _load(d_path, jax.eval_shape(lambda: init_params(DRAFT, jax.random.key(0))))
    info = json.loads(i_path.read_text())
    info["cached"] = str(t_path)
    return target, draft, info
  lang = PhraseLanguage(lang_spec)
  target, draft, info = train_models(lang, spec, log=log)
  _save(t_path, target)
  _save(d_path, draft)
  i_path.write_text(json.dumps(info, indent=1))
  info["cached"] = None
  return target, draft, info


def _eagle3_paths(cache_dir: Path, lang_spec: LanguageSpec, spec: TrainSpec,
                  eagle_spec: EagleSpec) -> tuple[Path, Path]:
  # Keyed by everything that made the target, plus the head's config and schedule: a cache
  # holding only the target gets its head trained (and added) on first use.
  key = _key(TARGET, DRAFT, lang_spec, spec, "v1", EAGLE3, eagle_spec, "eagle3-v1")
  return cache_dir / f"eagle3-{key}.npz", cache_dir / f"eagle3-info-{key}.json"


def is_eagle3_cached(cache_dir: Path, lang_spec: LanguageSpec, spec: TrainSpec,
                     eagle_spec: EagleSpec) -> bool:
  return all(p.exists() for p in _eagle3_paths(cache_dir, lang_spec, spec, eagle_spec))


def load_or_train_eagle3(cache_dir: Path, lang_spec: LanguageSpec, spec: TrainSpec,
                         eagle_spec: EagleSpec, target: Params, *, retrain: bool = False,
                         log=print) -> tuple[Eagle3Weights, dict]:
  """The `EAGLE3` head of `target` (the one `load_or_train(..., spec)` returns) from
  `cache_dir`, training and caching it if absent."""
  cache_dir.mkdir(parents=True, exist_ok=True)
  (cache_dir / ".gitignore").write_text("*\n")
  w_path, i_path = _eagle3_paths(cache_dir, lang_spec, spec, eagle_spec)
  if not retrain and is_eagle3_cached(cache_dir, lang_spec, spec, eagle_spec):
    like = {"params": jax.eval_shape(lambda: init_eagle3(EAGLE3, jax.random.key(0))),
            "d2t": jax.ShapeDtypeStruct((EAGLE3.draft_vocab_size,), jnp.int32)}
    saved = _load(w_path, like)
    info = json.loads(i_path.read_text())
    info["cached"] = str(w_path)
    return Eagle3Weights(params=saved["params"], d2t=saved["d2t"]), info
  weights, info = train_eagle3_head(target, PhraseLanguage(lang_spec), eagle_spec, log=log)
  _save(w_path, {"params": weights.params, "d2t": weights.d2t})
  i_path.write_text(json.dumps(info, indent=1))
  info["cached"] = None
  return weights, info
