"""Pure-functional target models (Llama 3 / Qwen2 / Qwen3), KV cache, draft heads, HF I/O."""

from specjax.models.cache import KVCache, attention_mask
from specjax.errors import CheckpointError, ConfigError
from specjax.models.config import Llama3RopeScaling, ModelConfig
from specjax.models.heads import (HeadOutput, medusa_logits, mtp_forward, mtp_head_logits,
                                  mtp_logits_all)
from specjax.models.hf import config_from_hf, config_to_hf, load_hf, save_hf
from specjax.models.params import count_params, init_params, param_axes
from specjax.models.transformer import (ForwardOutput, causal_mask, embed, forward, rms_norm,
                                        unembed)

__all__ = [
    "CheckpointError", "ConfigError", "ForwardOutput", "HeadOutput", "KVCache",
    "Llama3RopeScaling", "ModelConfig", "attention_mask", "causal_mask", "config_from_hf",
    "config_to_hf", "count_params", "embed", "forward", "init_params", "load_hf",
    "medusa_logits", "mtp_forward", "mtp_head_logits", "mtp_logits_all", "param_axes",
    "rms_norm", "save_hf", "unembed",
]
