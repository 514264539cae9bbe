"""Speculative vs plain decoding (temperature 1, or greedy), side by side in one engine and run.

    python benchmarks/spec_decode.py                  # full run (21 rows x 4 batches): over an
                                                      # hour on 2 cores (batch 1 ~20 min), plus
                                                      # ~8-14 min of training on first use
    python benchmarks/spec_decode.py --batches 1,4 --rows "eagle3 chain4,eagle3 adaptive"
    python benchmarks/spec_decode.py --quick          # smoke: batch 1/4, 6 variants, 32 tokens
    python benchmarks/spec_decode.py --batches 16 --repeats 7 --json out.json
    python benchmarks/spec_decode.py --batches 1 --temperature 0   # greedy

Models (see `_spec_models.py`): a float32 Llama-style GQA target whose trunk alone has > 25M
parameters, with 3 MTP modules and 3 Medusa heads, a 2-layer draft model sharing its
vocabulary, and an EAGLE-3 head (one decoder layer on the target's streams at aux layers
(2, 4, 5), a 512-token draft vocabulary). All are trained here, on this CPU, on the
procedural phrase language whose held-out documents the benchmark then decodes (the drafters
on the target's own temperature-1 samples; the EAGLE-3 head with `specjax.supervised.eagle3`:
training-time test over 3 steps, the target's distributions as soft labels); the parameters
are cached (`--cache-dir`, default `benchmarks/.cache/`, which ignores itself in git) so
reruns skip training. The head has a cache file of its own, keyed by the target's key and
its own schedule: a cache holding only the target gets a head on first use, without
retraining the target.

For every batch size and every drafter/tree, `specjax.decoding.generate` runs from the same
prompts (ragged lengths) with the same `max_new_tokens` and keys as the plain baseline. All
programs are compiled first; then the repeats are interleaved round-robin over the variants,
so a burst of load from other processes hits every column alike, each repeat starting one
variant later than the last, so that no row always runs right after the same one (in fixed
order, the batch-64 adaptive rows, which ran exactly plain decoding's program, read
0.95-0.98x in two runs in a row). Reported per row:

- `plain tok/s`, `spec tok/s`: generated tokens (sum of `result.lengths`) / median wall time.
- `ratio`: spec tok/s / plain tok/s. `spread` is the (max - min) / median of the per-repeat
  spec/plain time ratios, to show how noisy the machine was.
- `acc len`: mean acceptance length, `stats.tokens_per_round` (tokens emitted per row-round;
  1 for plain decoding), and `acc@d`, the fraction of row-rounds whose depth-d draft was kept.
- `drafts`: mean draft tokens verified per row-round, `stats.drafts_per_round` (the tree's
  nodes; fewer when a drafter with a `confidence` threshold stops rows early).
- `eff`: engine efficiency = ratio / acc len. It factors exactly into `tail` x 1 / `cost`:
  - `rounds`: loop iterations of the speculative run (the plain run takes max_new - 1);
    `tail` = mean rounds a row needed / `rounds`. Rows accept different numbers of tokens and
    the loop runs until the slowest row is done, so large batches pay for their stragglers.
  - `cost`: wall time per speculative round / wall time per plain round (one decode step):
    what a round of drafting + verifying + committing costs in plain steps.
- `verify`: the target forward of one round alone (`ForwardProbe`): the tree's N + 1 tokens
  per row (root + nodes) with its ancestor mask, `advance=0`, the drafter's `hidden_layers`,
  against a donated cache of the run's batch and size whose rows hold prompt + max_new / 2
  entries, divided by the same forward for one token (T = 1, a plain decode step's forward).
  Medians over `--forward-pairs` (step, verify) pairs timed right after each of the row's
  runs, so they share its load. 1 for plain decoding.
- `draft`: `cost` - `verify`, in plain steps: drafting plus the rest of a speculative round
  beyond its forward (acceptance test, commit, drafter update). The unit of `cost` is a plain
  round (its forward F1 plus sampling and loop work o), that of `verify` the bare forward F1,
  so exactly `draft` = (X - `verify` x o) / (F1 + o), with X the speculative round's time
  outside its forward: a drafter that costs (nearly) nothing can show a slightly negative
  `draft`. The log line `plain round ... of which the T=1 forward ...` gives F1 + o and F1.
- `ideal`: `acc len` / `verify`: the ratio a free drafter and a free engine (no drafting,
  no per-round overhead, no stragglers) would reach with this tree's acceptance and
  verification cost.
- `eng eff`: `ratio` / `ideal` = `tail` x `verify` / `cost`: the share of the ideal that the
  drafter, the engine's per-round work and the stragglers leave.

Adaptive rows (`tree` = `adaptive`) run `specjax.decoding.Adaptive` over a menu of chains:
each round runs plain decoding or the chain with the most expected tokens per second, from
costs that `calibrate` measured at the row's batch size just before (cached under
`--cache-dir`/calibration) and acceptance counted as the run goes. The log and the table
show the share of rounds each entry ran; the summary compares each adaptive row with plain
decoding, with the best fixed tree of its own drafter (what its menu chooses among; also
paired by repeat: the median over repeats of the two rows' ratio within one repeat) and with
the best fixed row of its batch (any drafter). Their `verify` is each entry's verify forward
(plain decoding's: the T=1 step) weighted by the share of rounds the entry ran, so `draft`
is what the adaptive row's rounds cost beyond the verifies they ran.

Rows are `Variant`s (`variants()`); a drafter with its own parameters names them with
`Variant.params_name`, a key of the `drafter_params` dict built in `main`. The JSON output
(`--json`) holds every field of `Row`, plain rows included, with `verify_ms` / `step_ms`,
the medians behind `verify`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _spec_models as M  # noqa: E402
from specjax.decoding import (Adaptive, DraftModelDrafter, DraftTree,  # noqa: E402
                              Eagle3Drafter, MedusaDrafter, MTPDrafter, NGramDrafter,
                              SamplingConfig, calibrate, generate)
from specjax.decoding.loop_state import compaction_buckets  # noqa: E402
from specjax.decoding.policy import describe  # noqa: E402
from specjax.models import KVCache, forward  # noqa: E402

PROMPT_LEN = 32          # prompt buffer; each row's prompt length is drawn in [16, 32]
EVAL_SEED = 10_000       # held-out documents (training uses seeds < 100)
CONFIDENCE = 0.4         # rows with a per-row draft length stop below this draft probability


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row of the table: a drafter with a tree (or plain decoding, which must come first).

  Attributes:
    drafter_name, tree_name: the row's labels.
    drafter: a `specjax.decoding` drafter, or None for plain decoding.
    tree: the draft tree (empty for plain decoding).
    params_name: key of this drafter's parameters in the `drafter_params` dict given to
      `bench_batch` (passed to `generate` as `drafter_params`); None when the drafter owns no
      parameters (MTP and Medusa heads live in the target's, n-gram has none); the draft
      model's and the EAGLE-3 head's (`Eagle3Weights`) are their own.
    quick: also run under `--quick`.
    menu: for an adaptive row, the trees `Adaptive` chooses from every round (plain decoding
      included); its costs are measured by `calibrate` at the row's batch size before the
      row is timed (cached on disk under `--cache-dir`). `tree` is then the menu's deepest;
      the `verify` column probes every entry and weighs them by the rounds they ran.
    compaction: halvings of the batch as rows finish (`generate(compaction=...)`).
  """

  drafter_name: str
  tree_name: str
  drafter: Any
  tree: DraftTree
  params_name: str | None = None
  quick: bool = False
  menu: tuple[DraftTree, ...] | None = None
  compaction: int = 0


def variants(sampled: bool, quick: bool) -> list[Variant]:
  """The rows of every batch. A new drafter is one more `Variant` here, plus an entry in the
  `drafter_params` dict built in `main` when it has parameters of its own."""
  mtp, medusa = MTPDrafter(sampled=sampled), MedusaDrafter(sampled=sampled)
  draft = DraftModelDrafter(M.DRAFT, sampled=sampled)
  eagle3 = Eagle3Drafter(M.EAGLE3, sampled=sampled)
  confident_draft = dataclasses.replace(draft, confidence=CONFIDENCE)
  confident_eagle3 = dataclasses.replace(eagle3, confidence=CONFIDENCE)
  chains = lambda *ks: tuple(DraftTree.chain(k) for k in ks)
  out = [
      Variant("plain", "-", None, DraftTree.empty(), quick=True),
      Variant("mtp", "chain1", mtp, DraftTree.chain(1)),
      Variant("mtp", "chain2", mtp, DraftTree.chain(2)),
      Variant("mtp", "chain3", mtp, DraftTree.chain(3), quick=True),
      Variant("mtp", "tree(3,1,1)", mtp, DraftTree.from_widths((3, 1, 1))),
      Variant("medusa", "chain3", medusa, DraftTree.chain(3), quick=True),
      Variant("draft model", "chain3", draft, DraftTree.chain(3), params_name="draft model",
              quick=True),
      Variant("n-gram", "chain3", NGramDrafter(max_ngram=3), DraftTree.chain(3), quick=True),
      # EAGLE-3 drafts each depth with one layer pass, like MTP, but the same layer serves
      # every depth (trained on its own outputs), so it is not capped at MTP's 3 modules and
      # a deeper chain costs one more pass per depth; the tree is MTP's, like for like.
      Variant("eagle3", "chain3", eagle3, DraftTree.chain(3), params_name="eagle3",
              quick=True),
      Variant("eagle3", "chain4", eagle3, DraftTree.chain(4), params_name="eagle3"),
      Variant("eagle3", "chain6", eagle3, DraftTree.chain(6), params_name="eagle3"),
      Variant("eagle3", "tree(3,1,1)", eagle3, DraftTree.from_widths((3, 1, 1)),
              params_name="eagle3"),
      # Adaptive: each round picks plain decoding or one of the menu's chains, by measured
      # cost and running acceptance (`specjax.decoding.Adaptive`).
      Variant("mtp", "adaptive", mtp, DraftTree.chain(3), menu=chains(1, 2, 3), quick=True),
      Variant("draft model", "chain6", draft, DraftTree.chain(6), params_name="draft model"),
      Variant("draft model", "adaptive", draft, DraftTree.chain(8), params_name="draft model",
              menu=chains(1, 2, 3, 4, 6, 8)),
      Variant("eagle3", "adaptive", eagle3, DraftTree.chain(6), params_name="eagle3",
              menu=chains(1, 2, 3, 4, 6), quick=True),
      # The same, gathering the live rows into B/2 and then B/4 rows as rows finish.
      Variant("eagle3", "adaptive+compact", eagle3, DraftTree.chain(6), params_name="eagle3",
              menu=chains(1, 2, 3, 4, 6), compaction=2),
      # Draft length per row and round: each row stops drafting once the draft's own
      # probability falls below CONFIDENCE; the rounds' tree is the cap (`confidence`).
      Variant("draft model", f"chain8 c{CONFIDENCE}", confident_draft, DraftTree.chain(8),
              params_name="draft model"),
      Variant("draft model", f"adaptive c{CONFIDENCE}", confident_draft, DraftTree.chain(8),
              params_name="draft model", menu=chains(1, 2, 3, 4, 6, 8)),
      Variant("eagle3", f"chain8 c{CONFIDENCE}", confident_eagle3, DraftTree.chain(8),
              params_name="eagle3"),
      Variant("eagle3", f"adaptive c{CONFIDENCE}", confident_eagle3, DraftTree.chain(8),
              params_name="eagle3", menu=chains(1, 2, 3, 4, 6, 8)),
  ]
  return [v for v in out if v.quick] if quick else out


def eval_prompts(lang: M.PhraseLanguage, batch: int) -> tuple[np.ndarray, np.ndarray]:
  """`[batch, PROMPT_LEN]` held-out document prefixes (right-padded) and ragged lengths."""
  rng = np.random.default_rng(EVAL_SEED)
  docs, _ = lang.batch(rng, batch, PROMPT_LEN)
  lengths = rng.integers(PROMPT_LEN // 2, PROMPT_LEN + 1, batch).astype(np.int32)
  docs = np.where(np.arange(PROMPT_LEN)[None, :] < lengths[:, None], docs, M.PAD)
  return docs.astype(np.int32), lengths


def model_quality(lang: M.PhraseLanguage, target, draft) -> dict[str, float]:
  """Held-out cross-entropy of target and draft model vs the language's process entropy."""
  rng = np.random.default_rng(EVAL_SEED + 1)
  toks, ent = lang.batch(rng, 32, 128)
  out = {"process_entropy": float(ent[:, 1:].mean())}
  pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
  for name, params, cfg in (("target", target, M.TARGET), ("draft", draft, M.DRAFT)):
    logits = jax.jit(lambda p, t: forward(p, cfg, t, pos).logits)(params, jnp.asarray(toks))
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(toks)[:, 1:, None], -1)[..., 0]
    out[f"{name}_ce"] = float(nll.mean())
    out[f"{name}_top1"] = float((jnp.argmax(logits[:, :-1], -1) == toks[:, 1:]).mean())
  return out


@dataclasses.dataclass
class Row:
  drafter: str
  tree: str
  batch: int
  plain_tps: float
  spec_tps: float
  ratio: float
  spread: float
  acc_len: float
  drafts: float
  eff: float
  acc_depth: list[float]
  compile_s: float
  spec_ms: float
  plain_ms: float
  rounds: float
  tail: float
  cost: float
  verify: float       # one verify forward / one T=1 forward (1 for plain)
  draft: float        # cost - verify, in plain steps
  ideal: float        # acc_len / verify
  engine_eff: float   # ratio / ideal
  verify_ms: float    # median verify forward (the T=1 forward for plain)
  step_ms: float      # median T=1 forward timed alongside this row
  tree_share: str = ""  # adaptive rows: share of rounds each menu entry ran
  segments: float = 0.0  # adaptive rows: runs of one tree per call (new tree or bucket, drafter on)
  per_repeat: list[float] = dataclasses.field(default_factory=list)  # ratio in each repeat


def _timed(fn, *args) -> tuple[Any, float]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


class ForwardProbe:
  """The target forward of one round of `generate`, alone: [root] + the tree's N nodes per row
  with the tree's ancestor mask and `advance=0`, against a cache whose rows hold `committed`
  entries. An empty tree makes it one plain decode step (T = 1). Each call returns its
  seconds.

  It is the call `DecodeLoop._verify` makes (same positions, mask, `hidden_layers`), jitted
  with the cache donated and threaded through the calls, as in `decode_step.py`: the K/V of
  the new tokens are written into the caller's buffers in place, nothing is committed, so
  every call does the same work.
  """

  def __init__(self, params, tree: DraftTree, hidden_layers: tuple[int, ...],
               committed: jax.Array, max_len: int, key: jax.Array):
    self.params = params
    batch = committed.shape[0]
    depths, mask = tree.depths, tree.ancestor_mask

    def verify(params, cache, tokens):
      positions = cache.lengths[:, None] + depths[None, :]
      out = forward(params, M.TARGET, tokens, positions, cache, new_mask=mask, advance=0,
                    hidden_layers=hidden_layers)
      # Argmax in the graph as a decoding engine does; the root's features stand in for what
      # a drafter reads, so the requested layers are not dead code.
      return (jnp.argmax(out.logits, -1).astype(jnp.int32),
              tuple(h[:, 0] for h in out.intermediates), out.cache)

    # The cache is donated so XLA writes the tree's K/V into it in place, as the engine's
    # loop does; without donation every call would also copy the whole cache.
    self._fn = jax.jit(verify, donate_argnums=(1,))
    k_tok, k_kv = jax.random.split(key)
    cache = KVCache.create(M.TARGET, batch, max_len)
    kv_keys = jax.random.split(k_kv, 2 * len(cache.keys))
    rand = lambda kk, buf: jax.random.normal(kk, buf.shape, buf.dtype)
    self.cache = cache.replace(
        keys=tuple(rand(kk, buf) for kk, buf in zip(kv_keys[::2], cache.keys)),
        values=tuple(rand(kk, buf) for kk, buf in zip(kv_keys[1::2], cache.values)),
    ).set_lengths(committed)
    self.tokens = jax.random.randint(k_tok, (batch, tree.num_nodes + 1), 0,
                                     M.TARGET.vocab_size, jnp.int32)

  def __call__(self) -> float:
    (_, _, self.cache), dt = _timed(self._fn, self.params, self.cache, self.tokens)
    return dt


def bench_batch(target, drafter_params: dict[str, Any], lang, batch: int, vs: list[Variant], *,
                max_new: int, repeats: int, forward_pairs: int, sampling: SamplingConfig,
                cache_dir: Path, log) -> list[Row]:
  """Rows for one batch size; `vs[0]` must be plain decoding (every ratio's baseline)."""
  if vs[0].drafter is not None:
    raise ValueError(f"the first variant must be plain decoding, got {vs[0].drafter_name}")
  prompts, lengths = eval_prompts(lang, batch)
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)

  def runner(v: Variant):
    kw = dict(max_new_tokens=max_new, sampling=sampling)
    if v.drafter is not None:
      kw |= dict(drafter=v.drafter, tree=v.tree)
    if v.params_name is not None:
      if v.params_name not in drafter_params:
        raise KeyError(f"variant {v.drafter_name} {v.tree_name}: no drafter params named "
                       f"{v.params_name!r}; have {sorted(drafter_params)}")
      kw["drafter_params"] = drafter_params[v.params_name]
    if v.menu is not None:
      policy = Adaptive(v.menu)
      t = time.perf_counter()
      costs = calibrate(target, M.TARGET, v.drafter, policy,
                        batch_sizes=compaction_buckets(batch, v.compaction),
                        prompt_len=PROMPT_LEN, max_new_tokens=max_new, sampling=sampling,
                        drafter_params=kw.get("drafter_params"), cache_dir=cache_dir)
      log(f"  batch {batch:3d} {v.drafter_name} adaptive: costs ({time.perf_counter() - t:.0f}s)"
          "\n" + "\n".join("    " + line for line in costs.format(policy.menu).splitlines()))
      kw |= dict(tree=None, speculation=policy.with_costs(costs), compaction=v.compaction)
    return lambda key: generate(target, M.TARGET, prompts, lengths, key, **kw)

  def probes_of(v: Variant, key: jax.Array) -> list[ForwardProbe | None]:
    """The verify forward of each tree the row runs (its menu's, for an adaptive row); None
    for plain decoding's, which is the T=1 step the row's pairs time anyway."""
    trees = Adaptive(v.menu).menu if v.menu else (v.tree,)
    # The state halfway through the run, and the cache size `generate` allocates by default.
    max_len = min(PROMPT_LEN + max_new + max(t.num_nodes for t in trees) + 1,
                  M.TARGET.max_position)
    return [ForwardProbe(target, t, v.drafter.hidden_layers(M.TARGET), lengths + max_new // 2,
                         max_len, jax.random.fold_in(key, e))
            if v.drafter is not None and t.num_nodes else None
            for e, t in enumerate(trees)]

  runs = [runner(v) for v in vs]
  compile_s = []
  for v, run in zip(vs, runs):
    t = time.perf_counter()
    jax.block_until_ready(run(jax.random.key(0)))
    compile_s.append(time.perf_counter() - t)
  step_probe = ForwardProbe(target, DraftTree.empty(), (), lengths + max_new // 2,
                            min(PROMPT_LEN + max_new + 1, M.TARGET.max_position),
                            jax.random.key(0))
  probes = [probes_of(v, jax.random.key(i)) for i, v in enumerate(vs)]
  for p in (step_probe, *(p for ps in probes for p in ps if p is not None)):
    p()  # compile and warm up
    p()
  times = [[] for _ in vs]
  tokens = [[] for _ in vs]
  tpr = [[] for _ in vs]
  drafts = [[] for _ in vs]
  depth = [[] for _ in vs]
  rounds = [[] for _ in vs]
  tree_rounds = [[] for _ in vs]
  segments = [[] for _ in vs]
  row_rounds = [[] for _ in vs]
  step_s = [[] for _ in vs]
  verify_s = [[[] for _ in ps] for ps in probes]  # [row][menu entry] seconds
  for r in range(repeats):
    key = jax.random.key(1 + r)
    for j in range(len(runs)):
      i = (j + r) % len(runs)
      run = runs[i]
      t = time.perf_counter()
      res = jax.block_until_ready(run(key))
      times[i].append(time.perf_counter() - t)
      tokens[i].append(int(res.lengths.sum()))
      tpr[i].append(float(res.stats.tokens_per_round))
      drafts[i].append(float(res.stats.drafts_per_round))
      depth[i].append(np.asarray(res.stats.accepted_per_depth))
      rounds[i].append(int(res.stats.rounds))
      tree_rounds[i].append(np.asarray(res.stats.tree_rounds))
      segments[i].append(int(res.stats.segments))
      row_rounds[i].append(float(np.mean(res.stats.row_rounds)))
      # The row's forwards right after its run, in (step, verify) pairs, so that they see
      # the same load as each other and as the run.
      for _ in range(forward_pairs):
        step_s[i].append(step_probe())
        for e, p in enumerate(probes[i]):
          if p is not None:
            verify_s[i][e].append(p())
  plain_tps = statistics.median(n / t for n, t in zip(tokens[0], times[0]))
  per_step = statistics.median(times[0]) / float(np.mean(rounds[0]))
  step_ms = 1e3 * statistics.median(x for xs in step_s for x in xs)
  log(f"  batch {batch:3d} plain round {1e3 * per_step:.2f} ms, of which the T=1 forward "
      f"{step_ms:.2f} ms")
  rows = []
  for i, v in enumerate(vs):
    tps = statistics.median(n / t for n, t in zip(tokens[i], times[i]))
    per_rep = [(n / t) / (n0 / t0) for n, t, n0, t0 in zip(tokens[i], times[i], tokens[0],
                                                            times[0])]
    ratio = tps / plain_tps
    acc_len = float(np.mean(tpr[i]))
    spread = (max(per_rep) - min(per_rep)) / statistics.median(per_rep)
    n_rounds = float(np.mean(rounds[i]))
    tail = float(np.mean(row_rounds[i])) / n_rounds
    per_round = statistics.median(times[i]) / n_rounds
    cost = per_round / per_step
    # Each tree's verify forward, weighed by the rounds it ran (one tree: its own).
    step = statistics.median(step_s[i])
    share = np.sum(tree_rounds[i], 0) if v.menu else np.ones(1)
    share = share / max(share.sum(), 1)
    verify_ms = 1e3 * float(sum(w * (statistics.median(xs) if xs else step)
                                for w, xs in zip(share, verify_s[i])))
    verify = verify_ms / (1e3 * step)
    ideal = acc_len / verify
    rows.append(Row(drafter=v.drafter_name, tree=v.tree_name, batch=batch, plain_tps=plain_tps,
                    spec_tps=tps, ratio=ratio, spread=spread, acc_len=acc_len,
                    drafts=float(np.mean(drafts[i])),
                    eff=ratio / acc_len, acc_depth=[float(x) for x in np.mean(depth[i], 0)],
                    compile_s=compile_s[i], spec_ms=1e3 * statistics.median(times[i]),
                    plain_ms=1e3 * statistics.median(times[0]), rounds=n_rounds, tail=tail,
                    cost=cost, verify=verify, draft=cost - verify, ideal=ideal,
                    engine_eff=ratio / ideal, verify_ms=verify_ms,
                    step_ms=1e3 * statistics.median(step_s[i]),
                    tree_share=_tree_share(v, tree_rounds[i]),
                    segments=float(np.mean(segments[i])), per_repeat=per_rep))
    log(f"  batch {batch:3d} {v.drafter_name:12s} {v.tree_name:12s} ratio {ratio:5.2f} "
        f"acc len {acc_len:4.2f} drafts {rows[-1].drafts:4.2f} eff {ratio / acc_len:4.2f} = tail {tail:4.2f} / cost "
        f"{cost:4.2f} = verify {verify:4.2f} + draft {cost - verify:4.2f}; ideal "
        f"{ideal:4.2f}, engine eff {ratio / ideal:4.2f} (compile {compile_s[i]:.1f}s)"
        + (f"; rounds by tree: {rows[-1].tree_share} in {rows[-1].segments:.1f} runs"
           if v.menu else ""))
  return rows


def _tree_share(v: Variant, tree_rounds: list[np.ndarray]) -> str:
  """`plain 10% chain3 90%`: the share of rounds each menu entry ran (adaptive rows only)."""
  if v.menu is None:
    return ""
  total = np.sum(tree_rounds, 0)
  menu = Adaptive(v.menu).menu
  return " ".join(f"{describe(t)} {100 * n / total.sum():.0f}%" for t, n in zip(menu, total)
                  if n)


MIN_REPEATS = 3  # a ratio from fewer repeats is printed as too short to measure


def ratio_text(r: Row) -> str:
  """A row's ratio to plain decoding as the tables state it: with its repeats' range, or
  marked too short to measure when it rests on fewer than `MIN_REPEATS` repeats."""
  if len(r.per_repeat) < MIN_REPEATS:
    return f"{r.ratio:.2f} (too short to measure: {len(r.per_repeat)} repeat(s))"
  low, high = min(r.per_repeat), max(r.per_repeat)
  return f"{r.ratio:.2f} (repeats {low:.2f}-{high:.2f}{', 1.0 within' if low <= 1 <= high else ''})"


def print_table(rows: list[Row]) -> None:
  head = (f"{'drafter':12s} {'tree':12s} {'batch':>5s} {'plain tok/s':>11s} "
          f"{'spec tok/s':>10s} {'ratio':>6s} {'spread':>6s} {'acc len':>7s} {'drafts':>6s} "
          f"{'eff':>5s} "
          f"{'rounds':>6s} {'tail':>5s} {'cost':>5s} {'verify':>6s} {'draft':>5s} "
          f"{'ideal':>5s} {'eng eff':>7s}  acc@d")
  print(head)
  print("-" * len(head) + "-" * 16)
  for r in rows:
    if r.drafter == "plain":
      continue
    short = "*" if len(r.per_repeat) < MIN_REPEATS else " "
    print(f"{r.drafter:12s} {r.tree:12s} {r.batch:5d} {r.plain_tps:11.1f} {r.spec_tps:10.1f} "
          f"{r.ratio:5.2f}{short} {100 * r.spread:5.0f}% {r.acc_len:7.2f} {r.drafts:6.2f} {r.eff:5.2f} "
          f"{r.rounds:6.1f} "
          f"{r.tail:5.2f} {r.cost:5.2f} {r.verify:6.2f} {r.draft:5.2f} {r.ideal:5.2f} "
          f"{r.engine_eff:7.2f}  "
          + " ".join(f"{a:.2f}" for a in r.acc_depth)
          + (f"  [{r.tree_share}]" if r.tree_share else ""))
  if any(len(r.per_repeat) < MIN_REPEATS for r in rows):
    print(f"* fewer than {MIN_REPEATS} repeats: too short to measure; the ratio is shown, it "
          "is not a speedup (--repeats)")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true",
                  help="smoke mode: batch 1 and 4, the variants marked quick, 32 new tokens, "
                       "2 repeats")
  ap.add_argument("--batches", default=None, help="comma-separated batch sizes (1,4,16,64)")
  ap.add_argument("--repeats", type=int, default=None, help="timed runs per variant (5)")
  ap.add_argument("--max-new", type=int, default=None, help="max_new_tokens (96)")
  ap.add_argument("--forward-pairs", type=int, default=3,
                  help="(T=1 forward, verify forward) pairs timed after each run (3)")
  ap.add_argument("--cache-dir", default=str(Path(__file__).resolve().parent / ".cache"))
  ap.add_argument("--retrain", action="store_true", help="ignore cached parameters")
  ap.add_argument("--argmax-drafts", action="store_true",
                  help="deterministic top-w drafts + matching verification instead of sampled "
                       "drafts + rejection verification")
  ap.add_argument("--temperature", type=float, default=1.0,
                  help="sampling temperature of every row (0: greedy) (1.0)")
  ap.add_argument("--json", default=None, help="also write the rows to this file")
  ap.add_argument("--rows", default=None,
                  help="only these rows, comma-separated 'drafter tree' names (e.g. "
                       "'eagle3 chain4,eagle3 adaptive'); plain decoding always runs")
  args = ap.parse_args(argv)
  batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,4,16,64")).split(",")]
  repeats = args.repeats or (2 if args.quick else 5)
  max_new = args.max_new or (32 if args.quick else 96)
  log = lambda s: print(s, flush=True)
  t_start = time.perf_counter()
  log(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs), "
      f"load average {os.getloadavg()[0]:.1f}")

  lang_spec = M.LanguageSpec()
  lang = M.PhraseLanguage(lang_spec)
  train_spec, eagle_spec = M.TrainSpec(), M.EagleSpec()
  cache = Path(args.cache_dir)
  if args.quick and not args.retrain and not M.is_cached(cache, lang_spec, train_spec):
    train_spec = M.QUICK_TRAIN
    log("--quick without cached models: training the short QUICK_TRAIN schedule")
  target, draft, info = M.load_or_train(cache, lang_spec, train_spec, retrain=args.retrain,
                                        log=log)
  if args.quick and not args.retrain and not M.is_eagle3_cached(cache, lang_spec, train_spec,
                                                                eagle_spec):
    eagle_spec = M.QUICK_EAGLE
    log("--quick without a cached EAGLE-3 head: training the short QUICK_EAGLE schedule")
  if info.get("cached"):
    log(f"parameters from cache {info['cached']} (trained in {info['train_s']:.0f}s)")
  else:
    log(f"trained in {info['train_s']:.0f}s: target {info['target_phase1_s']:.0f}s, draft "
        f"{info['draft_phase1_s']:.0f}s, sampling {info['sample_s']:.0f}s, distillation "
        f"{info['distill_s']:.0f}s")
  eagle3, eagle_info = M.load_or_train_eagle3(cache, lang_spec, train_spec, eagle_spec, target,
                                              retrain=args.retrain, log=log)
  info["eagle3"] = eagle_info
  acc = lambda xs: " ".join(f"{x:.3f}" for x in xs)
  origin = f"from cache {eagle_info['cached']} " if eagle_info.get("cached") else ""
  log(f"EAGLE-3 head {origin}(trained in {eagle_info['train_s']:.0f}s + "
      f"{eagle_info['sample_s']:.0f}s sampling); "
      f"per-step TTT accuracy (top-1 == target argmax): training batches "
      f"{acc(eagle_info['train_accuracy'])}, held out {acc(eagle_info['held_out_accuracy'])}; "
      f"draft vocabulary covers {100 * eagle_info['vocab_coverage_held_out']:.2f}% of "
      f"held-out sampled tokens")
  counts = M.param_counts(target)
  log(f"target: {counts['total']:,} parameters (trunk {counts['trunk']:,}, MTP "
      f"{counts['mtp']:,}, Medusa {counts['medusa']:,}), float32; draft model "
      f"{M.count_params(draft):,}; EAGLE-3 head {M.count_params(eagle3.params):,} "
      f"(W={M.EAGLE3.draft_vocab_size}, aux layers {M.EAGLE3.aux_layers})")
  quality = model_quality(lang, target, draft)
  log(f"held-out CE (nats/token): target {quality['target_ce']:.3f} (top-1 "
      f"{quality['target_top1']:.2f}), draft {quality['draft_ce']:.3f} (top-1 "
      f"{quality['draft_top1']:.2f}); process entropy of the language "
      f"{quality['process_entropy']:.3f}")

  sampling = SamplingConfig(temperature=args.temperature)
  vs = variants(sampled=not args.argmax_drafts, quick=args.quick)
  if args.rows:
    wanted = {name.strip() for name in args.rows.split(",")}
    unknown = wanted - {f"{v.drafter_name} {v.tree_name}" for v in vs}
    if unknown:
      ap.error(f"--rows: no such rows {sorted(unknown)}; rows are "
               f"{[f'{v.drafter_name} {v.tree_name}' for v in vs[1:]]}")
    vs = [vs[0]] + [v for v in vs[1:] if f"{v.drafter_name} {v.tree_name}" in wanted]
  log(f"temperature {args.temperature}, prompts {PROMPT_LEN // 2}-{PROMPT_LEN} tokens, max_new_tokens "
      f"{max_new}, {repeats} repeats, drafts "
      f"{'argmax (matching)' if args.argmax_drafts else 'sampled (rejection)'}")
  # Parameters owned by drafters, by `Variant.params_name`.
  drafter_params = {"draft model": draft, "eagle3": eagle3}
  rows: list[Row] = []
  for b in batches:
    rows += bench_batch(target, drafter_params, lang, b, vs, max_new=max_new, repeats=repeats,
                        forward_pairs=args.forward_pairs, sampling=sampling,
                        cache_dir=cache / "calibration", log=log)
    # A batch's compiled loops serve no other batch. Kept, they pile up: one run over four
    # batches and every row once died compiling at batch 64 (LLVM: cannot allocate memory).
    jax.clear_caches()
  print()
  print_table(rows)
  by_batch = {}
  for r in rows:
    if r.drafter != "plain" and (r.batch not in by_batch or r.ratio > by_batch[r.batch].ratio):
      by_batch[r.batch] = r
  print()
  for b, r in by_batch.items():
    print(f"best at batch {b}: {r.drafter} {r.tree}: ratio {ratio_text(r)}, acc len "
          f"{r.acc_len:.2f}, eff {r.eff:.2f}, ideal {r.ideal:.2f}, engine eff "
          f"{r.engine_eff:.2f}")
  for r in rows:  # adaptive rows against plain, their drafter's best fixed tree, any row's
    if r.tree.startswith("adaptive"):
      fixed = [x for x in rows if x.batch == r.batch and not x.tree.startswith("adaptive")]
      best = max(fixed, key=lambda x: x.ratio)
      own = max((x for x in fixed if x.drafter in (r.drafter, "plain")),
                key=lambda x: x.ratio)  # plain decoding is on every menu
      # The same comparison repeat by repeat (both rows timed within one repeat): less
      # exposed to the machine's speed drifting between repeats than the medians' ratio.
      paired = statistics.median(a / b for a, b in zip(r.per_repeat, own.per_repeat))
      print(f"{r.tree} {r.drafter} at batch {r.batch}: {r.ratio:.2f}x plain, "
            f"{r.ratio / own.ratio:.2f}x its drafter's best fixed tree ({own.tree} "
            f"{own.ratio:.2f}x; paired by repeat {paired:.2f}x), {r.ratio / best.ratio:.2f}x "
            f"the best fixed row ({best.drafter} {best.tree} {best.ratio:.2f}x) "
            f"[{r.tree_share}]")
  print(f"load average at the end {os.getloadavg()[0]:.1f}; total "
        f"{time.perf_counter() - t_start:.0f}s")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"rows": [dataclasses.asdict(r) for r in rows], "quality": quality,
         "params": counts | {"eagle3": M.count_params(eagle3.params)}, "train": info,
         "max_new_tokens": max_new, "repeats": repeats, "forward_pairs": args.forward_pairs},
        indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
