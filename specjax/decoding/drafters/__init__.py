"""Drafters: the protocol (`Drafter`) and its implementations."""

from specjax.decoding.drafters.base import (AcceptedWindow, DraftContext, Drafter, NoState,
                                            Proposal, RoundResult, TargetFeatures,
                                            draft_level_by_level)
from specjax.decoding.drafters.draft_model import DraftModelDrafter, DraftModelState
from specjax.decoding.drafters.eagle3 import Eagle3Drafter, Eagle3State, Eagle3Weights
from specjax.decoding.drafters.medusa import MedusaDrafter
from specjax.decoding.drafters.mtp import MTPDrafter, MTPState
from specjax.decoding.drafters.ngram import NGramDrafter

__all__ = [
    "AcceptedWindow", "DraftContext", "DraftModelDrafter", "DraftModelState", "Drafter",
    "Eagle3Drafter", "Eagle3State", "Eagle3Weights", "MTPDrafter", "MTPState", "MedusaDrafter",
    "NGramDrafter", "NoState", "Proposal", "RoundResult", "TargetFeatures",
    "draft_level_by_level",
]
