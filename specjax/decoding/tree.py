"""Static draft-tree topologies.

A tree has a root (node 0: the last committed token, whose successor is being drafted) and
N draft nodes 1..N in topological order (every parent precedes its children). Everything
here is a Python int or a NumPy constant, so shapes derived from a tree are static.

Shape letters: see `specjax` (N draft nodes, D depth, C max children per node, M nodes at one
depth).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from specjax.checks import is_int
from specjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DraftTree:
  """Topology of a draft tree.

  Attributes:
    parents: parent of each draft node 1..N, as an index into [root] + nodes (0 = root).
      `parents[i - 1]` is the parent of node i and must be < i.
  """

  parents: tuple[int, ...]

  def __post_init__(self):
    if isinstance(self.parents, (str, bytes)) or not hasattr(self.parents, "__iter__"):
      raise ConfigError(f"DraftTree.parents={self.parents!r} is invalid: must be a sequence of "
                        "ints, the parent of each draft node (e.g. (0, 1) for a chain of 2)")
    parents = tuple(self.parents)
    for i, p in enumerate(parents, start=1):
      # bool is an int to Python, and a float parent would be truncated to a different tree.
      if not is_int(p) or not 0 <= p < i:
        raise ConfigError(
            f"DraftTree.parents[{i - 1}]={p!r} is invalid: node {i}'s parent must be an int "
            f"in [0, {i - 1}] (0 is the root; parents precede children)")
    # A tuple of Python ints: the tree is hashed as part of jit's static arguments.
    object.__setattr__(self, "parents", tuple(int(p) for p in parents))

  # Constructors ----------------------------------------------------------------------------

  @classmethod
  def empty(cls) -> DraftTree:
    """No drafts: plain autoregressive decoding."""
    return cls(())

  @classmethod
  def chain(cls, k: int) -> DraftTree:
    """A single path of k draft tokens."""
    if not (is_int(k) and k >= 0):
      raise ConfigError(f"chain length k={k!r} is invalid: must be an int >= 0")
    return cls(tuple(range(int(k))))

  @classmethod
  def from_widths(cls, widths: Sequence[int]) -> DraftTree:
    """Every node at depth d - 1 gets `widths[d - 1]` children; (4, 2, 1) has 4 + 8 + 8 nodes.

    Children of one parent are its top-1, top-2, ... candidates (see `rank`).
    """
    if isinstance(widths, (str, bytes)) or not hasattr(widths, "__iter__"):
      raise ConfigError(f"widths={widths!r} is invalid: must be a sequence of ints >= 1, the "
                        "children of each node at each depth (e.g. (4, 2, 1))")
    widths = tuple(widths)
    if not all(is_int(w) and w >= 1 for w in widths):
      raise ConfigError(f"widths={widths!r} is invalid: every width must be an int >= 1")
    widths = tuple(int(w) for w in widths)
    parents: list[int] = []
    frontier = [0]
    for w in widths:
      nxt = []
      for p in frontier:
        for _ in range(w):
          parents.append(p)
          nxt.append(len(parents))
      frontier = nxt
    return cls(tuple(parents))

  @classmethod
  def from_parents(cls, parents: Sequence[int]) -> DraftTree:
    """The tree of `parents` (ints, NumPy integers or a NumPy int array), checked as
    `DraftTree(parents)` checks them: a float or a string is refused, not truncated."""
    return cls(tuple(np.asarray(parents).tolist()) if isinstance(parents, np.ndarray)
               else parents)

  # Derived static structure ----------------------------------------------------------------

  @property
  def num_nodes(self) -> int:
    """N, draft nodes (excluding the root)."""
    return len(self.parents)

  @functools.cached_property
  def parent_array(self) -> np.ndarray:
    """`[N + 1]` parent of each node of [root] + nodes; the root's parent is -1."""
    return np.array((-1,) + self.parents, np.int32)

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """`[N + 1]` depth of each node; the root has depth 0."""
    depth = np.zeros(self.num_nodes + 1, np.int32)
    for i, p in enumerate(self.parents, start=1):
      depth[i] = depth[p] + 1
    return depth

  @property
  def depth(self) -> int:
    """D, the deepest node's depth (longest acceptable run of drafts)."""
    return int(self.depths.max())

  @functools.cached_property
  def ancestor_mask(self) -> np.ndarray:
    """`[N + 1, N + 1]` bool: `[i, j]` when j is i or an ancestor of i."""
    n = self.num_nodes + 1
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
      mask[i] |= mask[self.parent_array[i]]
    return mask

  @functools.cached_property
  def rank(self) -> np.ndarray:
    """`[N + 1]` index of each node among its parent's children (root: 0)."""
    rank = np.zeros(self.num_nodes + 1, np.int32)
    seen: dict[int, int] = {}
    for i, p in enumerate(self.parents, start=1):
      rank[i] = seen.get(p, 0)
      seen[p] = rank[i] + 1
    return rank

  @property
  def max_children(self) -> int:
    """C, the largest number of children of any node (0 for the empty tree)."""
    return int(np.bincount(np.array(self.parents, np.int64)).max()) if self.parents else 0

  @functools.cached_property
  def children(self) -> np.ndarray:
    """`[N + 1, max(C, 1)]` children of each node in rank order, padded with -1."""
    table = -np.ones((self.num_nodes + 1, max(self.max_children, 1)), np.int32)
    for i, p in enumerate(self.parents, start=1):
      table[p, self.rank[i]] = i
    return table

  def nodes_at_depth(self, d: int) -> np.ndarray:
    """Indices of the nodes at depth d, in order."""
    return np.nonzero(self.depths == d)[0].astype(np.int32)

  @functools.cached_property
  def level_slot(self) -> np.ndarray:
    """`[N + 1]` index of each node among the nodes of its depth (`nodes_at_depth`)."""
    slot = np.zeros(self.num_nodes + 1, np.int32)
    for d in range(self.depth + 1):
      nodes = self.nodes_at_depth(d)
      slot[nodes] = np.arange(len(nodes))
    return slot

  def path_to(self, node: int) -> np.ndarray:
    """`[depth(node)]` the nodes from depth 1 down to `node` (`node` last; empty for the root)."""
    path = []
    while node > 0:
      path.append(node)
      node = int(self.parent_array[node])
    return np.array(path[::-1], np.int32)

  def children_of(self, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The children of the nodes `parents [M]`, for filling them from per-parent candidates.

    Returns:
      `(children, owner, rank)`, one entry per child: child node indices in parent order, the
      index into `parents` of each child's parent, and the child's rank among its siblings (its
      candidate index: rank 0 takes the parent's best or first-drawn token).
    """
    position = {int(p): m for m, p in enumerate(parents)}
    children = np.array([c for p in parents for c in self.children[p] if c >= 0], np.int32)
    owner = np.array([position[int(self.parent_array[c])] for c in children], np.int32)
    return children, owner, self.rank[children]

  def max_children_of(self, parents: np.ndarray) -> int:
    """Largest number of children among `parents` (at least 1)."""
    return max(int((self.children[parents] >= 0).sum(1).max()), 1)

  def is_chain(self) -> bool:
    return self.parents == tuple(range(self.num_nodes))

  def __hash__(self):
    return hash(self.parents)

  def __eq__(self, other):
    return isinstance(other, DraftTree) and self.parents == other.parents
