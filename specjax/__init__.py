"""specjax: RL post-training in JAX with lossless speculative-decoding rollouts.

Shape letters. One glossary for the whole package: every docstring shape, shape comment and
einsum string in specjax uses these letters with these meanings, and a module's docstring
only lists the ones it uses.

  B  batch rows. In RL a row is one sample: B = prompts x group size, and the number of
     prompts is written B / G (rows are prompt-major: prompt i owns rows i*G .. i*G + G - 1).
  G  GRPO group size (samples per prompt).
  T  tokens in one forward pass; in RL, response tokens (at most max_new_tokens).
  P  prompt buffer width (prompts right-padded to it).
  L  sequence buffer width, P + max new tokens.
  S  KV-cache slots.
  E  d_model: embedding / residual-stream width.
  F  MLP hidden width (in a mixture-of-experts layer: one expert's).
  Z  routed experts of a mixture-of-experts layer (k of them per token).
  V  vocabulary.
  W  draft vocabulary (EAGLE-3), W <= V.
  Q  query heads.
  K  key/value heads.
  R  query heads per key/value head, Q / K.
  H  head_dim.
  U  the flattened query rows of one key/value head inside attention, R x T.
  N  draft-tree nodes, excluding the root ([root] + nodes is N + 1).
  D  draft-tree depth.
  C  largest number of children of one tree node.
  M  tree nodes at one depth.
  J  training-time-test steps (EAGLE-3).

Layers have no letter: say "one per layer". Products are written out (`[Q*H]`, `[2E]`).
Lowercase names in a shape (`[B, k]`, `[M, d]`) are local values defined where they are
used; an einsum that needs an axis outside this list (a flattened or concatenated axis, the
output side of a square matrix) uses X and says what X is in a comment next to it.
"""

from specjax.errors import (CheckpointError, ConfigError, RewardError, SpecjaxError, TaskError,
                            TokenizerError)

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "RewardError", "SpecjaxError", "TaskError",
           "TokenizerError", "__version__"]
