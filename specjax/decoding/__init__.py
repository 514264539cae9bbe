"""Speculative decoding: sampling, draft trees, drafters, lossless verification, `generate`."""

from specjax.decoding import verify
from specjax.decoding.drafters import (AcceptedWindow, DraftContext, Drafter, DraftModelDrafter,
                                       DraftModelState, Eagle3Drafter, Eagle3State,
                                       Eagle3Weights, MedusaDrafter, MTPDrafter, MTPState,
                                       NGramDrafter, NoState, Proposal, RoundResult,
                                       TargetFeatures, draft_level_by_level)
from specjax.decoding.calibrate import calibrate
from specjax.decoding.engine import DecodeLoop, DecodeState, generate
from specjax.decoding.policy import AcceptanceCounts, Adaptive, CostTable
from specjax.decoding.results import GenerationResult, GenerationStats
from specjax.decoding.sampling import SamplingConfig, processed_logprobs, reported_logprobs
from specjax.decoding.tree import DraftTree
from specjax.decoding.verify import (LosslessVerifier, Verifier, VerifyResult, verify_matching,
                                     verify_sampled)

__all__ = [
    "AcceptanceCounts", "AcceptedWindow", "Adaptive", "CostTable", "calibrate", "DecodeLoop", "DecodeState", "DraftContext", "DraftModelDrafter",
    "DraftModelState", "DraftTree", "Drafter", "Eagle3Drafter", "Eagle3State", "Eagle3Weights",
    "GenerationResult", "GenerationStats", "LosslessVerifier", "MTPDrafter", "MTPState",
    "MedusaDrafter", "NGramDrafter", "NoState", "Proposal", "RoundResult", "SamplingConfig",
    "TargetFeatures", "Verifier", "VerifyResult", "draft_level_by_level", "generate",
    "processed_logprobs", "reported_logprobs", "verify", "verify_matching", "verify_sampled",
]
