"""Speculative decoding: sampling, draft trees, drafters, lossless verification, `generate`."""

from specjax.decoding import verify
from specjax.decoding.calibrate import RoundParts, calibrate, round_parts
from specjax.decoding.drafters import (AcceptedWindow, DraftContext, DraftModelDrafter,
                                       DraftModelState, DraftSource, Drafter, Eagle3Drafter,
                                       Eagle3State, Eagle3Weights, FallbackDrafter,
                                       FallbackParams, FallbackState,
                                       GroupDrafter, GroupState, HistoryBank, HistoryDrafter,
                                       HistoryState, MTPDrafter, MTPState,
                                       MedusaDrafter, NGramDrafter, NoState, Proposal, RoundResult,
                                       TargetFeatures, build_drafter, check_draft_source,
                                       check_drafter_name, default_drafter, draft_level_by_level,
                                       drafter_names, needs_checkpoint, register_drafter)
from specjax.decoding.engine import DecodeLoop
from specjax.decoding.generation import generate
from specjax.decoding.loop_state import DecodeState
from specjax.decoding.policy import AcceptanceCounts, Adaptive, CostTable
from specjax.decoding.results import GenerationResult, GenerationStats
from specjax.decoding.sampling import SamplingConfig, processed_logprobs, reported_logprobs
from specjax.decoding.tree import DraftTree
from specjax.decoding.verify import (LosslessVerifier, Verifier, VerifyResult, verify_matching,
                                     verify_sampled)

__all__ = [
    "AcceptanceCounts", "AcceptedWindow", "Adaptive", "build_drafter", "calibrate",
    "check_draft_source", "check_drafter_name", "CostTable", "default_drafter", "DecodeLoop",
    "DecodeState", "draft_level_by_level", "DraftContext", "Drafter", "drafter_names",
    "DraftModelDrafter", "DraftModelState", "DraftSource", "DraftTree", "Eagle3Drafter",
    "Eagle3State", "Eagle3Weights", "generate", "GenerationResult", "GenerationStats",
    "FallbackDrafter", "FallbackParams", "FallbackState", "GroupDrafter", "GroupState",
    "HistoryBank",
    "HistoryDrafter", "HistoryState", "LosslessVerifier", "MedusaDrafter", "MTPDrafter",
    "MTPState", "needs_checkpoint", "NGramDrafter", "NoState", "processed_logprobs",
    "Proposal", "register_drafter", "reported_logprobs", "round_parts", "RoundParts",
    "RoundResult", "SamplingConfig", "TargetFeatures", "Verifier", "verify", "verify_matching",
    "verify_sampled", "VerifyResult",
]
