"""Speculation as the simulator sees it: a drafter, its acceptance, and the draft-tree menu.

A menu entry is a draft tree given by its widths (children per node at each depth, as
`specjax.decoding.DraftTree.from_widths`: (1, 1, 1) is a chain of 3, (3, 1, 1) three chains
of 3) and the tokens a row emits per round with it, E. For chains E follows from the
per-depth acceptance a_d, the probability that the path continues from depth d to d + 1
(`specjax.decoding.policy`'s a_{i,d}):

    E_j = 1 + sum_{m=1..j} prod_{d<m} a_d          (chain of j drafts; E_0 = 1: plain)

A mean acceptance length a for a chain of k drafts (a round's tokens, bonus included, the
figure papers quote: 3.3 for k = 3) is read as a constant a_d = alpha with E_k = a.
A tree's E depends on how the drafter ranks siblings, so it is given, not derived.

A row's tokens in one round, X, vary: P(X >= m + 1) = prod_{d<m} a_d, so for a chain of j

    Var X_j = sum_{m=0..j} (2m + 1) prod_{d<m} a_d - E_j^2

which `specjax.sim.simulate_rollout` turns into stragglers (rows that accepted less finish
rounds later, and the batch waits for the last). A tree's variance is not derived (0 unless
given).

Drafting cost per depth of an entry is one forward of the drafter's own spec over the live
rows x the entry's nodes at that depth (`drafter_spec`):
  mtp          one target layer (MoE layers stay MoE) + the shared output head + its input
               projection [2E -> E]: "one layer per depth"
  eagle3       one dense layer of the target's width (an MoE target's k experts' width), its
               fused-input projections and a `draft_vocab` head (32k tokens by default)
  draft-model  the whole draft model (its own parameters and KV cache)
  ngram        free (a lookup in the text so far)
The catch-up of a drafter's state over the tokens accepted last round is folded into that
per-depth forward.

Shape letters: see `specjax` (D depth, E d_model, N tree nodes).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.errors import ConfigError
from specjax.sim import _checks as C
from specjax.sim.model import ModelSpec

DRAFTERS = ("mtp", "eagle3", "draft-model", "ngram")


@dataclasses.dataclass(frozen=True)
class MenuEntry:
  """One draft tree the policy can run, with the tokens a row emits per round.

  Attributes:
    name: "plain", "chain3", "tree(3,1,1)".
    widths: children per node at each depth; () is plain decoding.
    expected_tokens: E, tokens a row emits per round (1 <= E <= depth + 1).
    token_variance: the variance of a row's tokens per round (0: every row emits exactly E
      every round, the fluid model).
  """

  name: str
  widths: tuple[int, ...]
  expected_tokens: float
  token_variance: float = 0.0

  def __post_init__(self):
    widths = tuple(self.widths) if isinstance(self.widths, (tuple, list)) else None
    C.require(widths is not None and all(C.is_int(w) and w >= 1 for w in widths),
              "MenuEntry.widths", self.widths, "must be a sequence of ints >= 1 (() = plain)")
    object.__setattr__(self, "widths", tuple(int(w) for w in widths))
    depth = len(widths)
    C.require(C.is_real(self.expected_tokens) and 1.0 <= self.expected_tokens <= depth + 1,
              f"{self.name}: expected_tokens", self.expected_tokens,
              f"must be in [1, depth + 1 = {depth + 1}] (a round emits at most {depth} "
              "accepted drafts + 1 bonus token)")
    C.require(C.is_real(self.token_variance) and 0 <= self.token_variance <= depth**2 / 4,
              f"{self.name}: token_variance", self.token_variance,
              f"must be in [0, depth^2 / 4 = {depth**2 / 4:g}] (tokens per round lie in "
              f"[1, {depth + 1}])")

  @property
  def depth(self) -> int:
    return len(self.widths)

  @property
  def nodes_per_depth(self) -> tuple[int, ...]:
    return tuple(int(x) for x in np.cumprod(self.widths))

  @property
  def nodes(self) -> int:
    return sum(self.nodes_per_depth)

  @property
  def verify_tokens(self) -> int:
    """Tokens per row in the verification forward: the root and the nodes."""
    return self.nodes + 1


PLAIN = MenuEntry("plain", (), 1.0)


def chain_expected_tokens(per_depth, length: int) -> float:
  """E of a chain of `length` drafts under per-depth acceptance `per_depth`."""
  return 1.0 + float(np.cumprod(np.asarray(per_depth[:length], float)).sum())


def chain_token_variance(per_depth, length: int) -> float:
  """Var X of a chain of `length` drafts: sum_m (2m + 1) P(X >= m + 1) - E^2."""
  reach = np.concatenate([[1.0], np.cumprod(np.asarray(per_depth[:length], float))])
  second = float(((2 * np.arange(reach.size) + 1) * reach).sum())
  return max(second - float(reach.sum()) ** 2, 0.0)


def per_depth_from_mean(draft_length: int, mean_acceptance: float) -> tuple[float, ...]:
  """The constant per-depth acceptance alpha whose chain of `draft_length` emits
  `mean_acceptance` tokens per round."""
  k = C.positive_int("draft_length", draft_length)
  C.require(C.is_real(mean_acceptance) and 1.0 <= mean_acceptance <= k + 1, "acceptance",
            mean_acceptance, f"the mean acceptance length must be in [1, draft_length + 1 = "
            f"{k + 1}]: a round emits at most {k} accepted drafts + 1 bonus token")
  lo, hi = 0.0, 1.0
  for _ in range(80):  # E_k(alpha) is increasing in alpha
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if chain_expected_tokens((mid,) * k, k) < mean_acceptance else (lo, mid)
  return ((lo + hi) / 2,) * k


@dataclasses.dataclass(frozen=True)
class Speculation:
  """A drafter, its acceptance and its menu of draft trees.

  Attributes:
    drafter: one of `DRAFTERS`.
    per_depth: a_d for d = 0 .. k - 1 (k = the draft length).
    trees: further menu entries (trees) with their measured E.
    draft_model: the draft model's spec (drafter "draft-model" only).
    draft_vocab: the EAGLE-3 head's vocabulary.
    online_training: the drafter is trained on each step's rollouts (adds its training FLOPs).
  """

  drafter: str
  per_depth: tuple[float, ...]
  trees: tuple[MenuEntry, ...] = ()
  draft_model: ModelSpec | None = None
  draft_vocab: int = 32000
  online_training: bool = False

  def __post_init__(self):
    if self.drafter not in DRAFTERS:
      raise ConfigError(f"drafter={self.drafter!r} is unknown: allowed {', '.join(DRAFTERS)}")
    per_depth = tuple(self.per_depth) if isinstance(self.per_depth, (tuple, list)) else ()
    C.require(bool(per_depth) and all(C.is_real(a) and 0 <= a <= 1 for a in per_depth),
              "Speculation.per_depth", self.per_depth,
              "must be one acceptance probability in [0, 1] per draft depth (at least one)")
    object.__setattr__(self, "per_depth", tuple(float(a) for a in per_depth))
    C.require(all(isinstance(t, MenuEntry) and t.depth >= 1 for t in self.trees),
              "Speculation.trees", self.trees, "must be MenuEntry trees of depth >= 1")
    C.positive_int("Speculation.draft_vocab", self.draft_vocab)
    if self.drafter == "draft-model" and not isinstance(self.draft_model, ModelSpec):
      raise ConfigError("drafter='draft-model' needs draft_model=<ModelSpec> (a preset: "
                        "specjax.sim.model_spec('qwen3-0.6b'))")

  @classmethod
  def chain(cls, drafter: str, draft_length: int, acceptance: float | None = None,
            per_depth=None, **kwargs) -> Speculation:
    """Chains of up to `draft_length` drafts, from a mean acceptance length or per depth."""
    k = C.positive_int("draft_length", draft_length)
    if (acceptance is None) == (per_depth is None):
      raise ConfigError("pass exactly one of acceptance (mean tokens per round, in [1, "
                        "draft_length + 1]) or per_depth (one probability per depth)")
    if per_depth is None:
      per_depth = per_depth_from_mean(k, acceptance)
    C.require(isinstance(per_depth, (tuple, list)) and len(per_depth) == k, "per_depth",
              per_depth, f"must hold draft_length={k} probabilities")
    return cls(drafter=drafter, per_depth=tuple(per_depth), **kwargs)

  @property
  def draft_length(self) -> int:
    return len(self.per_depth)

  @property
  def mean_acceptance(self) -> float:
    """E of the deepest chain."""
    return chain_expected_tokens(self.per_depth, self.draft_length)

  def chain_entry(self, length: int) -> MenuEntry:
    return MenuEntry(f"chain{length}", (1,) * length,
                     chain_expected_tokens(self.per_depth, length),
                     chain_token_variance(self.per_depth, length))

  @property
  def fixed(self) -> MenuEntry:
    """What a fixed (non-adaptive) rollout runs: the chain of the full draft length."""
    return self.chain_entry(self.draft_length)

  @property
  def menu(self) -> tuple[MenuEntry, ...]:
    """Plain decoding, chains 1 .. k, then the trees (the adaptive policy's choices)."""
    return (PLAIN, *(self.chain_entry(j) for j in range(1, self.draft_length + 1)), *self.trees)

  def drafter_spec(self, target: ModelSpec) -> ModelSpec | None:
    """The spec whose forward prices one drafting depth (None: drafting is free)."""
    d = target.d_model
    same = dict(d_model=d, n_heads=target.n_heads, n_kv_heads=target.n_kv_heads,
                head_dim=target.head_dim, weight_bytes=target.weight_bytes,
                kv_bytes=target.kv_bytes, tied_embeddings=True)  # embeddings are the target's
    if self.drafter == "mtp":
      return ModelSpec(f"{target.name} MTP module", n_layers=1, vocab=target.vocab,
                       mlp_dim=target.mlp_dim, n_experts=target.n_experts,
                       experts_per_token=target.experts_per_token,
                       expert_dim=target.expert_dim, extra_params=2 * d * d, **same)
    if self.drafter == "eagle3":
      qkv = target.n_heads * target.head_dim + 2 * target.n_kv_heads * target.head_dim
      return ModelSpec(f"{target.name} EAGLE-3 head", n_layers=1, vocab=self.draft_vocab,
                       mlp_dim=target.dense_mlp_dim, extra_params=3 * d * d + d * qkv, **same)
    if self.drafter == "draft-model":
      return self.draft_model
    return None

  def describe(self) -> str:
    rates = ", ".join(f"{a:.2f}" for a in self.per_depth)
    return (f"{self.drafter}, draft length {self.draft_length}, acceptance length "
            f"{self.mean_acceptance:.2f} (per depth {rates})")
