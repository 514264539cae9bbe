"""Pure-functional target models (Llama 3 / Qwen2 / Qwen3), KV cache, draft heads, HF I/O."""

from specjax.models.cache import KVCache, attention_mask
from specjax.errors import CheckpointError, ConfigError
from specjax.models.config import Llama3RopeScaling, ModelConfig
from specjax.models.eagle3 import (Eagle3Config, build_draft_vocab, check_d2t, count_tokens,
                                   default_aux_layers, eagle3_cache, eagle3_draft_logits,
                                   eagle3_layer, eagle3_param_axes, eagle3_ttt_logits,
                                   eagle3_ttt_loss, fuse, init_eagle3, select_aux,
                                   to_target_vocab)
from specjax.models.eagle3_io import (eagle3_config_from_hf, eagle3_config_to_hf, load_eagle3,
                                      save_eagle3)
from specjax.models.heads import (DRAFT_HEAD_KEYS, HeadOutput, medusa_logits, mtp_forward,
                                  mtp_head_logits, mtp_logits_all)
from specjax.models.hf import eos_token_ids, load_hf, save_hf
from specjax.models.hf_config import config_from_hf, config_to_hf
from specjax.models.lora import LoraAdapters, LoraConfig, init_lora, lora_axes
from specjax.models.params import check_params, count_params, init_params, param_axes
from specjax.models.transformer import (ForwardOutput, causal_mask, embed, forward, rms_norm,
                                        unembed)

__all__ = [
    "CheckpointError", "ConfigError", "DRAFT_HEAD_KEYS", "Eagle3Config", "ForwardOutput",
    "HeadOutput", "KVCache", "LoraAdapters", "LoraConfig", "Llama3RopeScaling", "ModelConfig",
    "attention_mask", "build_draft_vocab", "causal_mask", "check_d2t", "check_params",
    "config_from_hf", "config_to_hf", "count_params", "count_tokens", "default_aux_layers",
    "eagle3_cache", "eagle3_config_from_hf", "eagle3_config_to_hf", "eagle3_draft_logits",
    "eagle3_layer", "eagle3_param_axes", "eagle3_ttt_logits", "eagle3_ttt_loss", "embed",
    "eos_token_ids", "forward", "fuse", "init_eagle3", "init_lora", "init_params", "load_eagle3",
    "load_hf", "lora_axes", "medusa_logits", "mtp_forward", "mtp_head_logits", "mtp_logits_all",
    "param_axes", "rms_norm", "save_eagle3", "save_hf", "select_aux", "to_target_vocab", "unembed",
]
