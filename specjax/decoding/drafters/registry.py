"""Drafters by name: what `specjax generate --drafter NAME`, `ExperimentConfig(drafter=NAME)`
and a user's own code pick with a string.

A name maps to a builder `(DraftSource) -> (drafter, drafter_params)`: the target's config,
and for drafters with weights of their own (a draft model, an EAGLE-3 head) the directory to
load them from. A new drafter is one file (a `Drafter` subclass) and one line:

    register_drafter("bigram", lambda source: (BigramDrafter(), None))

"none" is reserved: plain decoding, no drafter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specjax.decoding.drafters.base import Drafter
from specjax.decoding.drafters.draft_model import DraftModelDrafter
from specjax.decoding.drafters.eagle3 import Eagle3Drafter, Eagle3Weights
from specjax.decoding.drafters.fallback import FallbackDrafter
from specjax.decoding.drafters.group import GroupDrafter
from specjax.decoding.drafters.history import HistoryDrafter
from specjax.decoding.drafters.medusa import MedusaDrafter
from specjax.decoding.drafters.mtp import MTPDrafter
from specjax.decoding.drafters.ngram import NGramDrafter
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.eagle3_io import load_eagle3
from specjax.models.hf import load_hf

NONE = "none"


@dataclasses.dataclass(frozen=True)
class DraftSource:
  """What a drafter is built from.

  Attributes:
    target: the configuration of the model it drafts for.
    checkpoint: the directory of the drafter's own weights (an HF draft model, an EAGLE-3
      head), for drafters that have any; None otherwise.
  """

  target: ModelConfig
  checkpoint: str | None = None


Builder = Callable[[DraftSource], "tuple[Drafter, Any]"]


def _draft_model(source: DraftSource) -> tuple[Drafter, Any]:
  params, config = load_hf(source.checkpoint)
  return DraftModelDrafter(config), params


def _eagle3(source: DraftSource) -> tuple[Drafter, Any]:
  config, params, d2t = load_eagle3(source.checkpoint, source.target)
  return Eagle3Drafter(config), Eagle3Weights(params=params, d2t=d2t)


# The shortest match a group drafter in front of a model drafter drafts from: a shorter one
# is a weaker guess than the model's (docs/decoding.md: on the demo's trained policy MTP
# chain-2 accepts 2.81 tokens per round alone, 2.42 behind group drafts from 2+ token matches).
CONFIDENT_NGRAM = 6

def group_in_front(drafter: Drafter) -> FallbackDrafter:
  """Group drafts where a confident match gives a whole one, `drafter` (a model) elsewhere:
  what "group+mtp", "group+eagle3" and "group+draft-model" build."""
  return FallbackDrafter(GroupDrafter(min_ngram=CONFIDENT_NGRAM, max_ngram=2 * CONFIDENT_NGRAM),
                         drafter)


def history_in_front(drafter: Drafter) -> FallbackDrafter:
  """History drafts where a confident match gives a whole one, `drafter` (a model) elsewhere:
  what "history+mtp", "history+eagle3" and "history+draft-model" build. (A GRPO run gives
  the history drafter its bank and the model its weights: `FallbackParams`.)"""
  return FallbackDrafter(HistoryDrafter(min_ngram=CONFIDENT_NGRAM,
                                        max_ngram=2 * CONFIDENT_NGRAM), drafter)


def _behind(front: Callable[[Drafter], FallbackDrafter], build: Builder) -> Builder:
  def both(source: DraftSource) -> tuple[Drafter, Any]:
    drafter, params = build(source)
    return front(drafter), params
  return both


_BUILDERS: dict[str, Builder] = {
    "mtp": lambda source: (MTPDrafter(), None),
    "medusa": lambda source: (MedusaDrafter(), None),
    "ngram": lambda source: (NGramDrafter(), None),
    # Each row drafts from its own text; a GRPO run sets group_size to its group size.
    "group": lambda source: (GroupDrafter(), None),
    # Group drafts where a long match gives a whole one, the model's MTP modules elsewhere.
    "group+mtp": lambda source: (group_in_front(MTPDrafter()), None),
    # Earlier responses to the same prompt (a GRPO run's train state keeps the bank), then the
    # group's and recent responses; in front of MTP, whole drafts from confident matches only.
    "history": lambda source: (HistoryDrafter(), None),
    "history+mtp": lambda source: (history_in_front(MTPDrafter()), None),
    "draft-model": _draft_model,
    "eagle3": _eagle3,
    # Group or history drafts in front of a draft model or an EAGLE-3 head (its weights the
    # checkpoint's).
    "group+draft-model": _behind(group_in_front, _draft_model),
    "group+eagle3": _behind(group_in_front, _eagle3),
    "history+draft-model": _behind(history_in_front, _draft_model),
    "history+eagle3": _behind(history_in_front, _eagle3),
}
_DRAFT_MODEL_FILES = "an HF draft model (sharing the target's tokenizer)"
_EAGLE3_FILES = ("an EAGLE-3 head (config.json + model.safetensors, e.g. from specjax "
                 "train-drafter)")
# Drafters with weights of their own, and what their `DraftSource.checkpoint` holds.
_CHECKPOINTS: dict[str, str] = {
    "draft-model": _DRAFT_MODEL_FILES, "eagle3": _EAGLE3_FILES,
    "group+draft-model": _DRAFT_MODEL_FILES, "group+eagle3": _EAGLE3_FILES,
    "history+draft-model": _DRAFT_MODEL_FILES, "history+eagle3": _EAGLE3_FILES,
}


def register_drafter(name: str, build: Builder, *, checkpoint: str | None = None,
                     replace: bool = False) -> None:
  """Make `name` build a drafter: `build(DraftSource) -> (drafter, drafter_params or None)`.

  `checkpoint`: for a drafter with weights of its own, what its checkpoint directory holds
  (the error for a missing one says it); None when it has none.

  Raises:
    ConfigError: `name` is empty, "none", not a string, or taken (unless `replace`), or
      `build` is not callable.
  """
  if not isinstance(name, str) or not name or name == NONE:
    raise ConfigError(f"drafter name {name!r} is invalid: a non-empty string other than "
                      f"{NONE!r}")
  if not callable(build):
    raise ConfigError(f"register_drafter({name!r}, {build!r}): build must be callable, "
                      "(DraftSource) -> (Drafter, drafter_params or None)")
  if name in _BUILDERS and not replace:
    raise ConfigError(f"drafter {name!r} is registered already; pass replace=True to "
                      "replace it")
  _BUILDERS[name] = build
  _CHECKPOINTS.pop(name, None)
  if checkpoint is not None:
    _CHECKPOINTS[name] = checkpoint


def drafter_names() -> tuple[str, ...]:
  """Every name `build_drafter` accepts, "none" first."""
  return (NONE, *sorted(_BUILDERS))


def check_drafter_name(name: Any, field: str = "drafter") -> None:
  """ConfigError naming `field` unless `name` is a registered drafter or "none"."""
  if name != NONE and (not isinstance(name, str) or name not in _BUILDERS):
    raise ConfigError(f"{field}={name!r} is invalid: allowed one of "
                      f"{', '.join(drafter_names())} (specjax.decoding.register_drafter "
                      "adds one)")


def needs_checkpoint(name: str) -> str | None:
  """What the checkpoint of drafter `name` holds, or None when it has no weights of its own."""
  return _CHECKPOINTS.get(name)


def check_draft_source(name: Any, checkpoint: str | None, field: str = "drafter",
                       checkpoint_field: str = "draft_checkpoint") -> None:
  """`check_drafter_name`, and a ConfigError when drafter `name` has weights of its own and
  `checkpoint` is None (before any model is loaded)."""
  check_drafter_name(name, field)
  what = needs_checkpoint(name)
  if what is not None and checkpoint is None:
    raise ConfigError(f"{field}={name!r} needs its weights: pass {checkpoint_field}=DIR, the "
                      f"directory of {what}")


def default_drafter(target: ModelConfig) -> str:
  """The drafter `target` supports with no weights of its own: its MTP modules, else its
  Medusa heads, else n-gram lookup (a public checkpoint has neither head)."""
  if not isinstance(target, ModelConfig):
    raise ConfigError(f"target={target!r} is invalid: must be the target's "
                      "specjax.models.ModelConfig")
  if target.num_mtp_modules:
    return "mtp"
  if target.num_medusa_heads:
    return "medusa"
  return "ngram"


def build_drafter(name: str, source: DraftSource) -> tuple[Drafter | None, Any]:
  """The drafter `name` for `source.target` and its own parameters (None when it has none);
  (None, None) for "none".

  Raises:
    ConfigError: an unknown name, a missing checkpoint (`check_draft_source`), or a builder
      that returns no `Drafter`.
  """
  if not isinstance(source, DraftSource):
    raise ConfigError(f"source={source!r} is invalid: must be a DraftSource(target=<the "
                      "target's ModelConfig>, checkpoint=<path or None>)")
  check_draft_source(name, source.checkpoint)
  if name == NONE:
    return None, None
  built = _BUILDERS[name](source)
  if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], Drafter)):
    raise ConfigError(f"the builder registered for drafter {name!r} returned {built!r}: it "
                      "must return (a specjax.decoding.Drafter, its params or None)")
  return built
