"""Speculative decoding: sampling, draft trees, drafters, lossless verification, `generate`."""

from specjax.decoding.drafters import (DraftContext, Drafter, DraftModelDrafter, MedusaDrafter,
                                       MTPDrafter, NGramDrafter, Proposal, RoundResult)
from specjax.decoding.engine import GenerationResult, GenerationStats, generate
from specjax.decoding.sampling import SamplingConfig, processed_logprobs, reported_logprobs
from specjax.decoding.tree import DraftTree
from specjax.decoding import verify
from specjax.decoding.verify import VerifyResult, verify_matching, verify_sampled

__all__ = [
    "DraftContext", "DraftModelDrafter", "DraftTree", "Drafter", "GenerationResult",
    "GenerationStats", "MTPDrafter", "MedusaDrafter", "NGramDrafter", "Proposal", "RoundResult",
    "SamplingConfig", "VerifyResult", "generate", "processed_logprobs", "reported_logprobs",
    "verify_matching", "verify_sampled",
]
