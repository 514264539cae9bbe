"""Drafters: the protocol (`Drafter`) and its implementations."""

from specjax.decoding.drafters.base import (AcceptedWindow, DraftContext, Drafter, NoState,
                                            Proposal, RoundResult, TargetFeatures,
                                            draft_level_by_level)
from specjax.decoding.drafters.draft_model import DraftModelDrafter, DraftModelState
from specjax.decoding.drafters.eagle3 import Eagle3Drafter, Eagle3State, Eagle3Weights
from specjax.decoding.drafters.fallback import FallbackDrafter, FallbackParams, FallbackState
from specjax.decoding.drafters.group import GroupDrafter, GroupState
from specjax.decoding.drafters.history import HistoryBank, HistoryDrafter, HistoryState
from specjax.decoding.drafters.medusa import MedusaDrafter
from specjax.decoding.drafters.mtp import MTPDrafter, MTPState
from specjax.decoding.drafters.ngram import NGramDrafter
from specjax.decoding.drafters.registry import (DraftSource, build_drafter, check_draft_source,
                                                check_drafter_name, default_drafter, drafter_names,
                                                needs_checkpoint, register_drafter)

__all__ = [
    "AcceptedWindow", "build_drafter", "check_draft_source", "check_drafter_name",
    "default_drafter", "draft_level_by_level", "DraftContext", "Drafter", "drafter_names",
    "DraftModelDrafter", "DraftModelState", "DraftSource", "Eagle3Drafter", "Eagle3State",
    "Eagle3Weights", "FallbackDrafter", "FallbackParams", "FallbackState", "GroupDrafter",
    "GroupState",
    "HistoryBank", "HistoryDrafter", "HistoryState", "MedusaDrafter", "MTPDrafter", "MTPState",
    "needs_checkpoint", "NGramDrafter",
    "NoState", "Proposal", "register_drafter", "RoundResult", "TargetFeatures",
]
