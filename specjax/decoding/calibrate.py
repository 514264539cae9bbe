"""Measure what a decoding round of each menu entry costs on the device at hand.

`calibrate` times the real round bodies of the adaptive loop (`DecodeLoop.round_of`: draft,
verify, emit, commit, drafter update) for every entry of a menu at a few batch sizes, inside
one compiled loop per entry and batch, as the difference between running n2 and n1 rounds
(so the prefill and the dispatch cancel). Beside the menu it measures what leaving the
drafter out would cost: a plain round of the loop with no drafter (`CostTable.alone`) and
the time the drafter adds to the prefill (`CostTable.setup`), so the policy can tell whether
speculating in a call pays at all; and what a change of tree costs (`CostTable.switch`:
rounds that alternate between plain decoding and the first tree, each a segment of its own
inside `lax.switch` as the loop runs them, less the two rounds). The drafter-free round is
also the yardstick: every entry is timed between two of its rounds and kept as a ratio to
them, the median ratio over the repeats times the yardstick's median. The policy only
compares costs with each other, and load from other processes slows an entry and the rounds
beside it alike, so it cancels in the ratio. Each entry still carries its own timing error, so
the drafting entries' costs are replaced by their least-squares fit in the work a round does,
a + b depth + c nodes (`_fit_to_work`, for menus with more drafting entries than that has
parameters), and an entry that does all the work of another (as many nodes at every depth, or
more) is never listed as cheaper than it (`_dominance_floor`). docs/decoding.md has the
measurements behind each of these choices.
Each measurement runs >= `MIN_SECONDS`; 7 repeats by default. The table is cached on
disk, keyed by device kind, model and drafter shapes, menu, batch sizes, prompt and cache sizes,
sampling, the jax version and a hash of the decoding and model code, so a second run (or the
next RL experiment on the same machine) reads it back, and a code change measures anew.

The cache lives in `$SPECJAX_CACHE_DIR/calibration` (default `~/.cache/specjax`); pass
`cache_dir=None` to always measure.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import statistics
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_int
from specjax.decoding.drafters.base import Drafter, Proposal
from specjax.decoding.engine import DecodeLoop
from specjax.decoding.policy import Adaptive, CostTable
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.params import Params, check_params
from specjax.models.transformer import forward

DEFAULT = "default"
MIN_SECONDS = 0.25  # the least time one measurement of an entry runs for


def default_cache_dir() -> pathlib.Path:
  root = os.environ.get("SPECJAX_CACHE_DIR") or pathlib.Path.home() / ".cache" / "specjax"
  return pathlib.Path(root) / "calibration"


def _shapes(tree: Any) -> list:
  return [[list(x.shape), str(x.dtype)] for x in jax.tree.leaves(tree)]


def _code_version() -> str:
  """A hash of the code a round runs (decoding and model sources): a table measured before
  the code changed is not reused."""
  root = pathlib.Path(__file__).resolve().parents[1]
  digest = hashlib.sha256()
  for path in sorted([*root.glob("decoding/**/*.py"), *root.glob("models/*.py")]):
    digest.update(path.read_bytes())
  return digest.hexdigest()[:16]


def _cache_key(loop: DecodeLoop, batches: Sequence[int], prompt_len: int, params: Params,
               drafter_params: Any, rounds: tuple[int, int]) -> str:
  device = jax.devices()[0]
  described = {
      "code": _code_version(), "jax": jax.__version__,
      "device": [device.platform, device.device_kind, jax.device_count()],
      "config": repr(loop.config), "drafter": repr(loop.drafter),
      "menu": [list(t.parents) for t in loop.menu], "batches": list(batches),
      "prompt_len": prompt_len, "max_new_tokens": loop.max_new_tokens, "max_len": loop.max_len,
      "sampling": repr(loop.sampling), "params": _shapes(params),
      "drafter_params": _shapes(drafter_params), "rounds": list(rounds),
  }
  return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


_warned_dirs: set[str] = set()


def _warn_unwritable(directory: pathlib.Path, err: OSError) -> None:
  """Warn once per directory that the cache cannot be written: the cache is an
  optimisation, so the call goes on with the table it measured."""
  if str(directory) not in _warned_dirs:
    _warned_dirs.add(str(directory))
    warnings.warn(f"calibration cache {directory} cannot be written ({err.strerror or err}); "
                  "tables are measured in memory and not kept (set SPECJAX_CACHE_DIR to a "
                  "writable directory, or pass cache_dir=None)", stacklevel=3)


def _keep_first(path: pathlib.Path, table: CostTable,
                fits: Callable[[CostTable], bool]) -> CostTable:
  """Store `table` at `path` unless a table that `fits` this calibration is there already,
  and return the stored one.

  Processes that calibrate the same configuration at the same time (the runs of one sweep,
  a run and its restart) then all decode with the table of whichever finished first, so
  their tree choices, and with them their samples, agree. A damaged or stale file (another
  menu or batch sizes, an older format) is replaced by `table`: kept, it would be measured
  again on every call and still returned.
  """
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  try:
    tmp.write_text(json.dumps(dataclasses.asdict(table)))
    os.link(tmp, path)  # atomic, and fails if the file exists
  except FileExistsError:
    try:
      kept = CostTable(**json.loads(path.read_text()))
    except (ValueError, TypeError, ConfigError):
      kept = None
    if kept is not None and fits(kept):
      return kept
    tmp.replace(path)  # a damaged or stale table: ours replaces it
  finally:
    tmp.unlink(missing_ok=True)
  return table


def _round_timer(loop: DecodeLoop, entry: int):
  """A compiled `(params, prompts, lengths, key, drafter_params, n) -> state`: the prefill
  and then exactly n rounds of `entry` (n traced, so one executable serves every n)."""

  @jax.jit
  def run(params, prompts, lengths, key, drafter_params, n):
    state = loop.prefill(params, prompts, lengths, key, drafter_params)
    # The whole state is returned: were only part of it an output, XLA would drop the work
    # no output depends on (a deeper MTP module kept in sync by a shallower entry, for one),
    # and the table would under-state what the entry costs inside the real loop.
    return jax.lax.fori_loop(0, n, lambda _, s: loop.round_of(entry, params, s), state)
  return run


def _switch_timer(loop: DecodeLoop, entries: tuple[int, int]):
  """Like `_round_timer`, but each round is a segment of its own inside `lax.switch`,
  alternating between two entries, as `DecodeLoop.segment` runs a change of tree: its time
  per round less the two entries' mean is what a change costs."""

  @jax.jit
  def run(params, prompts, lengths, key, drafter_params, n):
    def segment(entry: int, s):
      once = lambda s: s.generated.sum() < 0  # never, but not known to be so when compiled
      return jax.lax.while_loop(once, functools.partial(loop.round_of, entry, params),
                                loop.round_of(entry, params, s))
    branches = [functools.partial(segment, e) for e in entries]
    state = loop.prefill(params, prompts, lengths, key, drafter_params)
    return jax.lax.fori_loop(0, n, lambda i, s: jax.lax.switch(i % 2, branches, s), state)
  return run


def _covers(big: DraftTree, small: DraftTree) -> bool:
  """Whether a round of `big` does all the work of one of `small`: at least as many nodes at
  every depth of `small` (drafted one depth at a time, then verified together)."""
  return big.depth >= small.depth and all(
      len(big.nodes_at_depth(d)) >= len(small.nodes_at_depth(d))
      for d in range(1, small.depth + 1))


def _fit_to_work(menu: Sequence[DraftTree], seconds: list[list[float]]) -> list[list[float]]:
  """`seconds` with the drafting entries' costs replaced, per batch size, by their least-squares
  fit a + b depth + c nodes (a drafter pass per depth, a verified token per node), where
  there are more drafting entries than the fit has free parameters; plain decoding's as
  measured. Each entry is timed apart, so each carries its own timing error; the fit pools
  them."""
  drafting = [i for i, t in enumerate(menu) if t.num_nodes]
  work = np.array([[1.0, menu[i].depth, menu[i].num_nodes] for i in drafting])
  if len(drafting) <= np.linalg.matrix_rank(work):
    return seconds
  out = [list(row) for row in seconds]
  for j in range(len(seconds[0])):
    y = np.array([seconds[i][j] for i in drafting])
    fit = work @ np.linalg.lstsq(work, y, rcond=None)[0]
    for i, value in zip(drafting, fit):
      out[i][j] = max(float(value), 1e-7)
  return out


def _dominance_floor(menu: Sequence[DraftTree], seconds: list[list[float]]
                     ) -> list[list[float]]:
  """`seconds` with each entry's cost raised to the most that any entry it covers measured."""
  return [[max(seconds[k][j] for k, small in enumerate(menu) if _covers(tree, small))
           for j in range(len(seconds[i]))] for i, tree in enumerate(menu)]


def _prefill_timer(loop: DecodeLoop):
  """A compiled `(params, prompts, lengths, key, drafter_params) -> state`: the prefill."""
  return jax.jit(loop.prefill)


def _seconds_per_round(run, n: int, n1: int, args) -> float:
  """One measurement: the time of n rounds less that of n1 rounds, per round (the prefill
  and the dispatch cancel)."""
  t0 = time.perf_counter()
  jax.block_until_ready(run(*args, n1))
  t1 = time.perf_counter()
  jax.block_until_ready(run(*args, n))
  t2 = time.perf_counter()
  return ((t2 - t1) - (t1 - t0)) / (n - n1)


def _rounds_to_time(run, args, n1: int, n2: int) -> int:
  """Compile and warm up `run`, then the rounds one measurement of it runs: at least n2, and
  enough past n1 to last `MIN_SECONDS` (tiny rounds take microseconds: time enough of them to
  rise above the timer's noise)."""
  jax.block_until_ready(run(*args, n2))
  t0 = time.perf_counter()
  jax.block_until_ready(run(*args, n2))
  per_round = max(time.perf_counter() - t0, 1e-9) / n2
  return max(n2, n1 + int(np.ceil(MIN_SECONDS / per_round)))


def _median_seconds(fn, args, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _checked_shapes(batch_sizes: Any, prompt_len: Any, rounds: Any, repeats: Any
                    ) -> tuple[int, ...]:
  """The distinct batch sizes, increasing, after a clear error for any argument that cannot
  be measured."""
  count = lambda x: is_int(x) and x >= 1
  sizes = tuple(batch_sizes) if isinstance(batch_sizes, (tuple, list, range)) else ()
  if not sizes or not all(count(b) for b in sizes):
    raise ConfigError(f"batch_sizes={batch_sizes!r} is invalid: must be a non-empty sequence "
                      "of batch sizes (ints >= 1)")
  if not count(prompt_len):
    raise ConfigError(f"prompt_len={prompt_len!r} is invalid: must be an int >= 1 (the prompt "
                      "width of the calls the table is for)")
  if not (is_int(rounds) and rounds >= 1 and is_int(repeats) and repeats >= 1):
    raise ConfigError(f"rounds={rounds!r}, repeats={repeats!r}: both must be ints >= 1")
  return tuple(sorted(set(int(b) for b in sizes)))


def _menu_loop(config: ModelConfig, drafter: Drafter, menu: tuple[DraftTree, ...],
               prompt_len: int, max_new_tokens: int, sampling: SamplingConfig,
               max_len: int | None) -> DecodeLoop:
  """The adaptive loop a menu's rounds are timed in; by default its cache has room for the
  prompt, the response and the largest tree's nodes."""
  if max_len is None and isinstance(config, ModelConfig) and isinstance(max_new_tokens, int):
    max_len = min(prompt_len + max_new_tokens + max(t.num_nodes for t in menu) + 1,
                  config.max_position)
  # (otherwise DecodeLoop names the bad config or max_new_tokens)
  return DecodeLoop(config=config, max_new_tokens=max_new_tokens, max_len=max_len,
                    sampling=sampling, drafter=drafter, speculation=Adaptive(menu))


def _timing_args(loop: DecodeLoop, params: Params, drafter_params: Any, key: jax.Array,
                 batch: int, prompt_len: int) -> tuple:
  """The arguments of a timer at `batch` rows: random prompts of `prompt_len` tokens."""
  prompts = jax.random.randint(jax.random.fold_in(key, batch), (batch, prompt_len), 0,
                               loop.config.vocab_size, jnp.int32)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  loop.check_prompts(prompts, lengths)
  return (params, prompts, lengths, key, drafter_params)


def calibrate(params: Params, config: ModelConfig, drafter: Drafter,
              speculation: Adaptive | Sequence[DraftTree], *, batch_sizes: Sequence[int],
              prompt_len: int, max_new_tokens: int, drafter_params: Any = None,
              sampling: SamplingConfig = SamplingConfig(), max_len: int | None = None,
              rounds: int = 8, repeats: int = 7, cache_dir: Any = DEFAULT,
              verbose: bool = False) -> CostTable:
  """Seconds per round of each menu entry at each batch size, measured (or read from disk).

  Args:
    params, config, drafter, drafter_params, sampling: as for `generate`.
    speculation: the `Adaptive` policy (its menu is measured) or a menu of trees.
    batch_sizes: rows per compiled round to measure (the loop's batch; with compaction, each
      bucket's).
    prompt_len, max_new_tokens, max_len: the shapes of the calls the table is for (the cache
      size is part of what a round costs).
    rounds: the fewest rounds timed per measurement (more when rounds are so short that
      `MIN_SECONDS` would not be reached).
    repeats: measurements per entry (each a ratio to the drafter-free round); the median
      is kept.
    cache_dir: where tables are kept (default: `default_cache_dir()`); None: no disk cache.
    verbose: print the table.

  Returns:
    A `CostTable` with one row per entry of the normalised menu (plain decoding first), and
    the drafter-free plain round, the drafter's prefill and a change of tree at each batch
    size.
  """
  if isinstance(speculation, Adaptive):
    menu = speculation.menu
  elif isinstance(speculation, (tuple, list)):
    menu = Adaptive(tuple(speculation)).menu
  else:
    raise ConfigError(f"speculation={speculation!r} is invalid: must be an Adaptive policy "
                      "(its menu is measured) or a sequence of DraftTree")
  batches = _checked_shapes(batch_sizes, prompt_len, rounds, repeats)
  loop = _menu_loop(config, drafter, menu, prompt_len, max_new_tokens, sampling, max_len)
  check_params(params, config)  # a table timed on other weights would price other rounds
  if not (cache_dir is None or isinstance(cache_dir, (str, os.PathLike))):
    raise ConfigError(f"cache_dir={cache_dir!r} is invalid: must be a directory path, or None "
                      "for no disk cache")
  n1, n2 = 2, 2 + rounds
  fits = lambda table: (len(table.seconds) == len(menu) and table.batches == batches
                        and table.alone is not None and table.switch is not None)
  path = None
  if cache_dir is not None:
    root = default_cache_dir() if cache_dir == DEFAULT else pathlib.Path(cache_dir)
    path = root / f"{_cache_key(loop, batches, prompt_len, params, drafter_params, (n1, n2))}.json"
    if path.exists():
      try:
        table = CostTable(**json.loads(path.read_text()))
        if fits(table):
          if verbose:
            print(f"calibration read from {path}\n{table.format(menu)}")
          return table
      except (ValueError, TypeError, ConfigError, OSError):
        pass  # a damaged, stale or unreadable file: measure again and overwrite it

  if verbose:
    print(f"measuring what a round of each of the {len(menu)} menu entries costs at batch "
          f"{', '.join(map(str, batches))} (compiles each; about a minute per batch size on a "
          "CPU; cached for the next call)", flush=True)
  key = jax.random.key(0)
  alone_loop = loop.drafter_free(prompt_len)
  timed = [(loop, i) for i in range(len(menu))] + [(alone_loop, 0)]  # the last: no drafter
  pair = (0, min(1, len(menu) - 1))  # a change between plain decoding and the first tree
  seconds = [[0.0] * len(batches) for _ in timed]
  setup, switch = [0.0] * len(batches), [0.0] * len(batches)
  for j, b in enumerate(batches):
    args = _timing_args(loop, params, drafter_params, key, b, prompt_len)
    runs, counts = [], []
    timers = [_round_timer(timed_loop, i) for timed_loop, i in timed]
    timers.insert(-1, _switch_timer(loop, pair))  # (timed like one more entry)
    for run in timers:  # compile and warm up every entry first
      runs.append(run)
      counts.append(_rounds_to_time(run, args, n1, n2))
    prefills = [_prefill_timer(loop), _prefill_timer(alone_loop)]
    for prefill in prefills:
      jax.block_until_ready(prefill(*args))
    # Each entry is timed between two plain rounds without the drafter (the cheapest round,
    # the anchor) and kept as a ratio to their mean: load that slows a stretch of the
    # schedule slows an entry and its anchors alike, so a burst cancels instead of landing
    # on one entry of the table. The anchor's own cost is the median of all its timings.
    *entries, (anchor, anchor_n) = zip(runs, counts)
    ratios = [[] for _ in entries]
    anchors, extra = [], []
    for _ in range(repeats):
      before = _seconds_per_round(anchor, anchor_n, n1, args)
      anchors.append(before)
      for i, (run, n) in enumerate(entries):
        cost = _seconds_per_round(run, n, n1, args)
        after = _seconds_per_round(anchor, anchor_n, n1, args)
        anchors.append(after)
        ratios[i].append(cost / max(0.5 * (before + after), 1e-9))
        before = after
      with_drafter, without = (_median_seconds(f, args, 3) for f in prefills)
      extra.append(with_drafter - without)
    base = max(statistics.median(anchors), 1e-7)
    *ratios, changing = ratios
    for i, entry_ratios in enumerate(ratios):
      seconds[i][j] = max(statistics.median(entry_ratios) * base, 1e-7)
    seconds[-1][j] = base
    switch[j] = max(statistics.median(changing) * base
                    - 0.5 * (seconds[pair[0]][j] + seconds[pair[1]][j]), 0.0)
    setup[j] = max(statistics.median(extra), 0.0)
  seconds[:-1] = _dominance_floor(menu, _fit_to_work(menu, seconds[:-1]))
  table = CostTable(batches=batches, seconds=tuple(tuple(row) for row in seconds[:-1]),
                    alone=tuple(seconds[-1]), setup=tuple(setup), switch=tuple(switch))
  if path is not None:
    try:
      table = _keep_first(path, table, fits)
    except OSError as err:  # a read-only or full home (clusters, containers): measure anyway
      _warn_unwritable(path.parent, err)
  if verbose:
    print(f"calibration (seconds per round, median of {repeats})\n{table.format(menu)}")
  return table


@dataclasses.dataclass(frozen=True)
class _Echo(Drafter):
  """Drafts the root at every node with no model and no state, reading the target layers
  `layers` like the drafter it stands in for: a round of it is the engine's own work for a
  tree (one verify forward, acceptance, emit, commit, counts) and none of a drafter's."""

  layers: tuple[int, ...] = ()

  def hidden_layers(self, config: ModelConfig) -> tuple[int, ...]:
    return self.layers

  def propose(self, params, config, state, ctx, tree, sampling, key):
    b = ctx.seq.shape[0]
    return Proposal(tokens=jnp.broadcast_to(ctx.root[:, None], (b, tree.num_nodes))), state


def _verify_timer(loop: DecodeLoop, tree: DraftTree):
  """Like `_round_timer`, but each round is only the verify forward of `tree`: the target
  over root + nodes with the tree's mask, nothing committed. Its logits feed the carry, so
  no part of the forward is left out.

  A round's tokens and positions are new every round; here they must not look loop-invariant
  either, or XLA hoists the embedding, the first layer's projections and the rotary tables
  out of the loop, and the forward is under-timed (by 20-25% on a CPU, issue 33)."""

  @jax.jit
  def run(params, prompts, lengths, key, drafter_params, n):
    s = loop.prefill(params, prompts, lengths, key, drafter_params)
    tokens = jnp.broadcast_to(s.context.root[:, None], (s.seq.shape[0], tree.num_nodes + 1))
    positions = (s.seq_len - 1)[:, None] + jnp.asarray(tree.depths)[None, :]

    def body(_, carry):
      cache, total = carry
      # Through a barrier with the carry: opaque to the compiler whatever its math flags.
      now_tokens, now_positions, _ = jax.lax.optimization_barrier((tokens, positions, total))
      out = forward(params, loop.config, now_tokens, now_positions, cache,
                    new_mask=jnp.asarray(tree.ancestor_mask), advance=0,
                    hidden_layers=loop.hidden_layers)
      return out.cache, total + out.logits.max()
    return jax.lax.fori_loop(0, n, body, (s.cache, jnp.zeros((), jnp.float32)))
  return run


@dataclasses.dataclass(frozen=True)
class RoundParts:
  """Where a speculative round's time goes, per drafting tree and batch size (seconds).

  Attributes:
    trees: the drafting trees measured.
    batches: the batch sizes.
    round: `round[i][j]`, a whole round of tree i (draft, verify, emit, commit, update).
    engine: the same round with a drafter that does no work (`_Echo`).
    verify: the target's verify forward over tree i's root + nodes alone.
  """

  trees: tuple[DraftTree, ...]
  batches: tuple[int, ...]
  round: tuple[tuple[float, ...], ...]
  engine: tuple[tuple[float, ...], ...]
  verify: tuple[tuple[float, ...], ...]

  def drafting(self, i: int, j: int) -> float:
    """The drafter's share of a round: everything it adds to the engine's round."""
    return max(self.round[i][j] - self.engine[i][j], 0.0)

  def lean(self, i: int, j: int) -> float:
    """A round over its drafting plus one verify forward: what the engine adds to the work
    the tree needs (issue 33 bounds it at 1.3)."""
    return self.round[i][j] / max(self.drafting(i, j) + self.verify[i][j], 1e-12)

  def format(self) -> str:
    """One row per tree and batch: ms of the round, its drafting, the verify forward and the
    rest (the engine's own work), and the lean ratio."""
    lines = [f"{'tree':<12} {'B':>5} {'round':>9} {'drafting':>9} {'verify':>9} "
             f"{'rest':>9} {'lean':>6}"]
    for i, tree in enumerate(self.trees):
      name = f"chain{tree.depth}" if tree.is_chain() else f"{tree.num_nodes} nodes"
      for j, b in enumerate(self.batches):
        rest = self.engine[i][j] - self.verify[i][j]
        lines.append(f"{name:<12} {b:>5} " + " ".join(
            f"{1e3 * x:>7.3f}ms" for x in (self.round[i][j], self.drafting(i, j),
                                           self.verify[i][j], rest))
            + f" {self.lean(i, j):>6.2f}")
    return "\n".join(lines)


def round_parts(params: Params, config: ModelConfig, drafter: Drafter,
                trees: Sequence[DraftTree], *, batch_sizes: Sequence[int], prompt_len: int,
                max_new_tokens: int, drafter_params: Any = None,
                sampling: SamplingConfig = SamplingConfig(), rounds: int = 8,
                repeats: int = 5) -> RoundParts:
  """Measure where a round of each drafting tree goes: the whole round, the same round with a
  drafter that does no work, and the verify forward alone (each the median of `repeats`
  n-round less 2-round differences, taken in turn so that load hits all three alike).

  The trees form one adaptive menu (with plain decoding), as in `calibrate`: the drafter's
  state is built for the deepest, and the cache has the slots `calibrate`'s loop gives it.
  """
  menu = Adaptive(tuple(trees)).menu
  drafting = [i for i, t in enumerate(menu) if t.num_nodes]
  if not drafting:
    raise ConfigError(f"trees={trees!r}: round_parts needs at least one drafting tree")
  batches = _checked_shapes(batch_sizes, prompt_len, rounds, repeats)
  loop = _menu_loop(config, drafter, menu, prompt_len, max_new_tokens, sampling, None)
  echo = dataclasses.replace(loop, drafter=_Echo(loop.hidden_layers))
  n1, n2 = 2, 2 + rounds
  parts = {name: [[0.0] * len(batches) for _ in drafting]
           for name in ("round", "engine", "verify")}
  for j, b in enumerate(batches):
    args = _timing_args(loop, params, drafter_params, jax.random.key(0), b, prompt_len)
    for row, i in enumerate(drafting):
      timers = {"round": _round_timer(loop, i), "engine": _round_timer(echo, i),
                "verify": _verify_timer(echo, menu[i])}
      counts = {name: _rounds_to_time(run, args, n1, n2) for name, run in timers.items()}
      taken = {name: [] for name in timers}
      for _ in range(repeats):
        for name, run in timers.items():
          taken[name].append(_seconds_per_round(run, counts[name], n1, args))
      for name in timers:
        parts[name][row][j] = max(statistics.median(taken[name]), 1e-7)
  freeze = lambda rows: tuple(tuple(r) for r in rows)
  return RoundParts(trees=tuple(menu[i] for i in drafting), batches=batches,
                    **{name: freeze(rows) for name, rows in parts.items()})
