"""Drafters: the protocol and its implementations."""

from specjax.decoding.drafters.base import DraftContext, Drafter, Proposal, RoundResult
from specjax.decoding.drafters.draft_model import DraftModelDrafter
from specjax.decoding.drafters.medusa import MedusaDrafter
from specjax.decoding.drafters.mtp import MTPDrafter
from specjax.decoding.drafters.ngram import NGramDrafter

__all__ = ["DraftContext", "DraftModelDrafter", "Drafter", "MTPDrafter", "MedusaDrafter",
           "NGramDrafter", "Proposal", "RoundResult"]
