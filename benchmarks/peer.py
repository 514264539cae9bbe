"""specjax vs Hugging Face transformers on the same checkpoint: plain and speculative decoding.

    python benchmarks/peer.py                   # batch 1 and 8, greedy and T=1, 96 new tokens
                                                # (~10 min on 2 cores, plus spec_decode.py's
                                                # training on first use)
    python benchmarks/peer.py --quick           # smoke: batch 1, 24 new tokens, 2 repeats
    python benchmarks/peer.py --batches 1 --chain 4 --json out.json
    python benchmarks/peer.py --checkpoint MODEL_DIR [--draft DRAFT_DIR]   # your checkpoint

The peer is transformers' `generate` (PyTorch; the CPU wheel of the test extra), the reference
every user of a HF checkpoint has. Both libraries read one checkpoint directory: the target of
`spec_decode.py` (a > 25M-parameter Llama-style GQA model trained here on the phrase language,
its draft heads left out) and its 2-layer draft model, written by `specjax.models.save_hf`,
then loaded by `load_hf` and by `AutoModelForCausalLM.from_pretrained`. Before any timing the
two libraries' logits on held-out documents are compared (max |difference|).

Methods, each in both libraries where the peer has it:

- `plain`: autoregressive decoding.
- `n-gram chainK` / `prompt lookup K`: drafts of K tokens copied from the text after the
  latest earlier occurrence of the row's last 1..3 tokens (`NGramDrafter(max_ngram=3)`;
  transformers' `prompt_lookup_num_tokens=K, max_matching_ngram_size=3`).
- `draft model chainK` / `assisted K`: the 2-layer draft model proposes K tokens
  (`DraftModelDrafter`, with sampled drafts and rejection verification when sampling, as
  transformers does; transformers' `assistant_model` with `num_assistant_tokens=K`, the
  `constant` schedule and no confidence threshold, so both verify the same chain), and
  `assisted (defaults)`: transformers' assisted generation as it comes (up to 20 draft
  tokens, cut where the draft's probability falls under a threshold that starts at 0.4 and
  adapts), beside `draft model chain16 conf`: up to 16 draft tokens, each row cut where no
  drafted token reaches probability 0.4 (`DraftModelDrafter(confidence=0.4)`).

transformers runs speculative decoding for one sequence at a time only, so batches above 1
have its plain decoding alone. Prompts are held-out documents of one length (no padding);
no row stops early (`max_new_tokens` exactly). Greedy and temperature-1 sampling (no top-k /
top-p in either library).

All arms are warmed up (compiled, for specjax) first; then repeats are interleaved
(`specjax.timing.interleaved`). Per arm:

- `tok/s`: generated tokens / median seconds per call.
- `x plain`: its tok/s over the same library's plain decoding, repeat by repeat (median of
  per-repeat ratios): what speculation buys inside each library.
- `x peer`: its tok/s over the other library's same method (specjax over transformers),
  repeat by repeat. Where both run one method, this is the ratio to read.
- `tok/fwd`: generated tokens per target forward, 1 for plain decoding. specjax:
  `stats.tokens_per_round`, the tokens a row emitted per round after the prefill (whose one
  token is not counted); transformers: new tokens / calls of the target's `forward` (counted
  by a hook), the prefill included, since its assisted generation verifies the first draft in
  the prefill's call.
- `same`: under greedy decoding, rows whose tokens equal specjax's plain decoding (and the
  first position where a row differs). specjax's speculative rows must equal its plain ones
  token for token (the script exits with an error otherwise); transformers' rows may part
  from them where two logits nearly tie and the libraries' float32 arithmetic orders them
  differently.

`--checkpoint DIR` runs the same comparison on a HF checkpoint of your own (Llama 3, Qwen2,
Qwen3; float32 in both libraries), with `--draft DIR` a draft model of the same vocabulary for
the draft-model rows (without it those rows are left out). Its prompts are random token ids,
each row a random 8-token segment repeated, so that n-gram drafting has text to copy; the
logits are compared on random documents. Speculation's figures on random prompts say little
about its acceptance on your text; plain decoding's say how the two libraries run the model.

What this does not compare: `torch.compile` / static caches on the transformers side, and
serving engines (vLLM, SGLang), which need a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _spec_models as M  # noqa: E402
from specjax.decoding import (DraftModelDrafter, DraftTree, NGramDrafter,  # noqa: E402
                              SamplingConfig, generate)
from specjax.models import eos_token_ids, forward, load_hf, save_hf  # noqa: E402
from specjax.timing import interleaved  # noqa: E402

PROMPT_LEN = 32
EVAL_SEED = 10_000       # held-out documents (training uses seeds < 100)
DEEP, CONFIDENCE = 16, 0.4  # a long chain cut where the draft is unsure: as transformers'
                            # assisted generation comes (20 tokens, a 0.4 threshold)


@dataclasses.dataclass
class Arm:
  """One timed method of one library at one batch and sampling mode.

  Attributes:
    library: "specjax" or "transformers".
    method: the table's label.
    peer: the label of the same method in the other library, or None.
    run: a call with the repeat's index that returns `(tokens [B, N] int array, tokens per
      target forward after the prefill)`, done when it returns.
  """

  library: str
  method: str
  peer: str | None
  run: Callable[[int], tuple[np.ndarray, float]]


def write_checkpoints(target: M.Params, draft: M.Params, root: Path) -> tuple[Path, Path]:
  """The benchmark's target (trunk only) and draft model as HF checkpoint directories."""
  trunk = {k: v for k, v in target.items() if k not in ("mtp", "medusa")}
  config = dataclasses.replace(M.TARGET, num_mtp_modules=0, num_medusa_heads=0)
  save_hf(trunk, config, root / "target", pad_token_id=M.PAD, bos_token_id=M.BOS)
  save_hf(draft, M.DRAFT, root / "draft", pad_token_id=M.PAD, bos_token_id=M.BOS)
  return root / "target", root / "draft"


class ForwardCounter:
  """Counts the calls of a torch module's `forward` (a hook that outlives nothing else)."""

  def __init__(self, module):
    self.calls = 0
    module.register_forward_hook(self._hook)

  def _hook(self, module, args, output):
    self.calls += 1


def pad_id(path: Path) -> int:
  """The pad id transformers' `generate` is given for checkpoint `path` (config.json's
  pad_token_id, else its first EOS, else 0: no row is padded, it only silences a warning)."""
  pad = json.loads((path / "config.json").read_text()).get("pad_token_id")
  return pad if isinstance(pad, int) else next(iter(eos_token_ids(path)), 0)


def own_prompts(rng: np.random.Generator, vocab: int, batch: int, length: int) -> np.ndarray:
  """`[batch, length]` random ids, each row a random 8-token segment repeated (text that an
  n-gram drafter can copy from)."""
  segment = rng.integers(0, vocab, (batch, 8))
  return np.tile(segment, (1, -(-length // 8)))[:, :length].astype(np.int32)


def specjax_arms(paths: tuple[Path, Path | None], prompts: np.ndarray, max_new: int,
                 sampling: SamplingConfig, chain: int) -> list[Arm]:
  params, config = load_hf(paths[0])
  lengths = np.full((prompts.shape[0],), prompts.shape[1], np.int32)

  def arm(method: str, peer: str | None, drafter=None, tree=None, drafter_params=None) -> Arm:
    def run(r: int) -> tuple[np.ndarray, float]:
      out = generate(params, config, prompts, lengths, jax.random.key(r),
                     max_new_tokens=max_new, sampling=sampling, drafter=drafter, tree=tree,
                     drafter_params=drafter_params)
      tokens = np.asarray(jax.block_until_ready(out.tokens))
      return tokens, float(out.stats.tokens_per_round)
    return Arm("specjax", method, peer, run)

  arms = [arm("plain", "plain"),
          arm(f"n-gram chain{chain}", f"prompt lookup {chain}", NGramDrafter(max_ngram=3),
              DraftTree.chain(chain))]
  if paths[1] is None:
    return arms
  draft, draft_config = load_hf(paths[1])
  return arms + [
          arm(f"draft model chain{chain}", f"assisted {chain}",
              DraftModelDrafter(draft_config, sampled=sampling.temperature > 0),
              DraftTree.chain(chain), draft),
          arm(f"draft model chain{DEEP} conf", "assisted (defaults)",
              DraftModelDrafter(draft_config, sampled=sampling.temperature > 0,
                                confidence=CONFIDENCE), DraftTree.chain(DEEP), draft)]


def transformers_arms(paths: tuple[Path, Path | None], prompts: np.ndarray, max_new: int,
                      sampling: SamplingConfig, chain: int, pad: int) -> list[Arm]:
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32).eval()
  counter = ForwardCounter(model)
  ids = torch.tensor(prompts, dtype=torch.long)
  options = dict(max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad,
                 eos_token_id=None)
  if sampling.temperature > 0:
    options |= dict(do_sample=True, temperature=sampling.temperature, top_k=0, top_p=1.0)
  else:
    options |= dict(do_sample=False)

  def assistant(matched: bool):
    helper = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32).eval()
    if matched:  # the same chain as specjax's: K tokens every round
      helper.generation_config.num_assistant_tokens = chain
      helper.generation_config.num_assistant_tokens_schedule = "constant"
      helper.generation_config.assistant_confidence_threshold = 0.0
    return helper

  def arm(method: str, peer: str | None, **extra) -> Arm:
    def run(r: int) -> tuple[np.ndarray, float]:
      torch.manual_seed(r)
      counter.calls = 0
      with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **options, **extra)
      new = out[:, ids.shape[1]:].numpy()
      return new, new.shape[1] / counter.calls
    return Arm("transformers", method, peer, run)

  arms = [arm("plain", "plain")]
  if prompts.shape[0] == 1:  # transformers drafts for one sequence at a time
    arms.append(arm(f"prompt lookup {chain}", f"n-gram chain{chain}",
                    prompt_lookup_num_tokens=chain, max_matching_ngram_size=3))
  if prompts.shape[0] == 1 and paths[1] is not None:
    arms += [arm(f"assisted {chain}", f"draft model chain{chain}",
                 assistant_model=assistant(matched=True)),
             arm("assisted (defaults)", f"draft model chain{DEEP} conf",
                 assistant_model=assistant(matched=False))]
  return arms


def logit_gap(paths: tuple[Path, Path | None], docs: np.ndarray) -> float:
  """Max |specjax logits - transformers logits| of the target over `docs` `[B, T]`."""
  import torch
  from transformers import AutoModelForCausalLM
  params, config = load_hf(paths[0])
  positions = np.broadcast_to(np.arange(docs.shape[1]), docs.shape)
  ours = np.asarray(forward(params, config, docs, positions).logits)
  model = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32).eval()
  with torch.inference_mode():
    theirs = model(torch.tensor(docs, dtype=torch.long)).logits.numpy()
  return float(np.abs(ours - theirs).max())


def first_difference(tokens: np.ndarray, reference: np.ndarray) -> tuple[int, int | None]:
  """(rows equal to `reference`, first position where any row differs, or None)."""
  same = (tokens == reference).all(axis=1)
  differs = np.nonzero((tokens != reference).any(axis=0))[0]
  return int(same.sum()), (int(differs[0]) if differs.size else None)


def bench(arms: list[Arm], repeats: int, greedy: bool) -> list[dict[str, Any]]:
  """Warm every arm, time them interleaved, and return one table row per arm."""
  for a in arms:
    a.run(0)
  times, outputs = interleaved([a.run for a in arms], repeats)
  index = {(a.library, a.method): i for i, a in enumerate(arms)}
  plain_tokens = outputs[index[("specjax", "plain")]][0][0]
  rows = []
  for i, a in enumerate(arms):
    tokens = outputs[i][0][0]
    generated = tokens.size
    plain = index[(a.library, "plain")]
    other = "transformers" if a.library == "specjax" else "specjax"
    peer = index.get((other, a.peer))
    row = dict(library=a.library, method=a.method, batch=tokens.shape[0],
               seconds=float(np.median(times[i])),
               tok_s=generated / float(np.median(times[i])),
               x_plain=float(np.median(times[plain] / times[i])),
               x_peer=None, tok_per_forward=float(np.mean([o[1] for o in outputs[i]])))
    if peer is not None and a.library == "specjax":
      row["x_peer"] = float(np.median(times[peer] / times[i]))
    if greedy:
      row["same"], row["first_difference"] = first_difference(tokens, plain_tokens)
      if a.library == "specjax" and row["same"] != tokens.shape[0]:
        raise SystemExit(f"specjax {a.method} differs from its plain greedy decoding at "
                         f"position {row['first_difference']}: speculation was not lossless")
    rows.append(row)
  return rows


def format_rows(rows: list[dict[str, Any]], greedy: bool) -> list[str]:
  head = f"  {'library':<13}{'method':<26}{'tok/s':>8}{'x plain':>9}{'x peer':>8}{'tok/fwd':>9}"
  lines = [head + ("  same" if greedy else "")]
  for r in rows:
    peer = f"{r['x_peer']:.2f}" if r["x_peer"] is not None else "-"
    line = (f"  {r['library']:<13}{r['method']:<26}{r['tok_s']:8.0f}{r['x_plain']:9.2f}"
            f"{peer:>8}{r['tok_per_forward']:9.2f}")
    if greedy:
      where = "" if r["first_difference"] is None else f" (from {r['first_difference']})"
      line += f"  {r['same']}/{r['batch']}{where}"
    lines.append(line)
  return lines


def trained_setup(args: argparse.Namespace, rng: np.random.Generator, tmp: Path, log
                  ) -> tuple[tuple[Path, Path], int, Callable[[int, int], np.ndarray], np.ndarray]:
  """`spec_decode.py`'s trained target and draft model (trained on first use) as checkpoint
  directories under `tmp`; their pad id, a prompt maker and held-out documents."""
  lang_spec, train_spec = M.LanguageSpec(), M.TrainSpec()
  cache = Path(args.cache_dir)
  if args.quick and not M.is_cached(cache, lang_spec, train_spec):
    train_spec = M.QUICK_TRAIN
    log("--quick without cached models: training the short QUICK_TRAIN schedule")
  target, draft, _ = M.load_or_train(cache, lang_spec, train_spec, log=log)
  lang = M.PhraseLanguage(lang_spec)
  make_prompts = lambda b, n: lang.batch(rng, b, n)[0].astype(np.int32)
  return (write_checkpoints(target, draft, tmp), M.PAD, make_prompts,
          lang.batch(rng, 4, 64)[0].astype(np.int32))


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8)")
  ap.add_argument("--max-new", type=int, default=None, help="new tokens per row (default 96)")
  ap.add_argument("--chain", type=int, default=3, help="draft tokens per round, K (default 3)")
  ap.add_argument("--repeats", type=int, default=None, help="timed calls per arm (default 5)")
  ap.add_argument("--modes", default="greedy,sampled", help="greedy and / or sampled (T=1)")
  ap.add_argument("--quick", action="store_true",
                  help="smoke: batch 1, 24 new tokens, 2 repeats, the short training schedule "
                       "when no trained models are cached")
  ap.add_argument("--cache-dir", default=str(Path(__file__).parent / ".cache"),
                  help="trained models (shared with spec_decode.py)")
  ap.add_argument("--json", default=None, help="also write the rows to this file")
  ap.add_argument("--checkpoint", default=None,
                  help="a HF checkpoint directory of your own instead of the trained one")
  ap.add_argument("--draft", default=None, help="with --checkpoint: a draft model's directory")
  args = ap.parse_args(argv)
  if args.draft and not args.checkpoint:
    ap.error("--draft goes with --checkpoint")
  batches = [int(b) for b in (args.batches or ("1" if args.quick else "1,8")).split(",")]
  max_new = args.max_new or (24 if args.quick else 96)
  repeats = args.repeats or (2 if args.quick else 5)
  modes = args.modes.split(",")
  if not set(modes) <= {"greedy", "sampled"} or args.chain < 1 or min(batches) < 1:
    ap.error("--modes takes greedy and / or sampled; --chain and --batches must be >= 1")
  log = lambda s: print(s, flush=True)
  import torch
  import transformers
  transformers.utils.logging.set_verbosity_error()  # its loading bars and deprecation notes
  transformers.utils.logging.disable_progress_bar()
  t_start = time.perf_counter()
  log(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} with "
      f"{torch.get_num_threads()} threads, transformers {transformers.__version__}; "
      f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")

  rng = np.random.default_rng(EVAL_SEED)
  rows: list[dict[str, Any]] = []
  with tempfile.TemporaryDirectory() as tmp:
    if args.checkpoint:
      paths = (Path(args.checkpoint), Path(args.draft) if args.draft else None)
      config = load_hf(paths[0])[1]
      pad = pad_id(paths[0])
      make_prompts = lambda b, n: own_prompts(rng, config.vocab_size, b, n)
      docs = rng.integers(0, config.vocab_size, (4, 64)).astype(np.int32)
    else:
      paths, pad, make_prompts, docs = trained_setup(args, rng, Path(tmp), log)
    log(f"one checkpoint, two libraries: max |logit difference| {logit_gap(paths, docs):.2e} "
        f"over 4 held-out documents of 64 tokens")
    for mode in modes:
      sampling = SamplingConfig(0.0 if mode == "greedy" else 1.0)
      for batch in batches:
        prompts = make_prompts(batch, PROMPT_LEN)
        arms = (specjax_arms(paths, prompts, max_new, sampling, args.chain)
                + transformers_arms(paths, prompts, max_new, sampling, args.chain, pad))
        t = time.perf_counter()
        batch_rows = bench(arms, repeats, greedy=mode == "greedy")
        log(f"\n{mode}, batch {batch}, {max_new} new tokens, prompts of {PROMPT_LEN} "
            f"({time.perf_counter() - t:.0f}s)")
        for line in format_rows(batch_rows, mode == "greedy"):
          log(line)
        rows += [r | {"mode": mode} for r in batch_rows]
  log(f"\ndone in {time.perf_counter() - t_start:.0f}s")
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
