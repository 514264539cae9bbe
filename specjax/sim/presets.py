"""Named model specs: the architectures of public checkpoints (from their `config.json`), and
small ones that match this repository's CPU benchmarks; or a checkpoint's own `config.json`.

Parameter counts (computed, norms left out): llama3-8b 8.03B, qwen3-8b 8.19B, qwen3-32b 32.8B,
qwen3-235b-a22b 235.1B of which 22.2B active, qwen3-30b-a3b 30.5B / 3.4B active,
qwen3-a3b-dense 3.4B (the 30B-A3B's active size, dense),
qwen3-0.6b 0.60B, qwen3-1.7b 1.72B, llama3.2-1b 1.24B.
"""

from __future__ import annotations

import os
import pathlib

from specjax.errors import ConfigError
from specjax.files import read_object
from specjax.sim.model import ModelSpec

_QWEN_VOCAB, _LLAMA_VOCAB = 151936, 128256

MODELS: dict[str, ModelSpec] = {
    # benchmarks/decode_step.py's "25m" config, float32 as the CPU benchmarks run it.
    "tiny": ModelSpec("tiny", n_layers=12, d_model=384, n_heads=6, n_kv_heads=2, head_dim=64,
                      vocab=8192, mlp_dim=1024, weight_bytes=4, kv_bytes=4),
    "tiny-draft": ModelSpec("tiny-draft", n_layers=2, d_model=384, n_heads=6, n_kv_heads=2,
                            head_dim=64, vocab=8192, mlp_dim=1024, weight_bytes=4, kv_bytes=4),
    # benchmarks/accelerator.py's 1.1B bf16 model.
    "bench-1b": ModelSpec("bench-1b", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                          head_dim=64, vocab=32000, mlp_dim=8192),
    "llama3.2-1b": ModelSpec("llama3.2-1b", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                             head_dim=64, vocab=_LLAMA_VOCAB, mlp_dim=8192,
                             tied_embeddings=True),
    "llama3-8b": ModelSpec("llama3-8b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                           head_dim=128, vocab=_LLAMA_VOCAB, mlp_dim=14336),
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8,
                            head_dim=128, vocab=_QWEN_VOCAB, mlp_dim=3072, tied_embeddings=True),
    "qwen3-1.7b": ModelSpec("qwen3-1.7b", n_layers=28, d_model=2048, n_heads=16, n_kv_heads=8,
                            head_dim=128, vocab=_QWEN_VOCAB, mlp_dim=6144,
                            tied_embeddings=True),
    "qwen3-8b": ModelSpec("qwen3-8b", n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8,
                          head_dim=128, vocab=_QWEN_VOCAB, mlp_dim=12288),
    "qwen3-32b": ModelSpec("qwen3-32b", n_layers=64, d_model=5120, n_heads=64, n_kv_heads=8,
                           head_dim=128, vocab=_QWEN_VOCAB, mlp_dim=25600),
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", n_layers=48, d_model=2048, n_heads=32,
                               n_kv_heads=4, head_dim=128, vocab=_QWEN_VOCAB, n_experts=128,
                               experts_per_token=8, expert_dim=768),
    # Qwen3-30B-A3B's active size as a dense model (its 8 routed experts as one 6144-wide
    # MLP): what speculation on the MoE is compared with (README, "Mixture of experts").
    "qwen3-a3b-dense": ModelSpec("qwen3-a3b-dense", n_layers=48, d_model=2048, n_heads=32,
                                 n_kv_heads=4, head_dim=128, vocab=_QWEN_VOCAB, mlp_dim=6144),
    "qwen3-235b-a22b": ModelSpec("qwen3-235b-a22b", n_layers=94, d_model=4096, n_heads=64,
                                 n_kv_heads=4, head_dim=128, vocab=_QWEN_VOCAB, n_experts=128,
                                 experts_per_token=8, expert_dim=1536),
}

# The draft model `--drafter draft-model` uses for a target unless told otherwise: the
# family's smallest sibling, sharing the tokenizer.
DEFAULT_DRAFT_MODEL = {"tiny": "tiny-draft", "bench-1b": "tiny-draft",
                       "llama3-8b": "llama3.2-1b", "llama3.2-1b": "tiny-draft"}


def model_spec(name: str) -> ModelSpec:
  """The named preset, or the model of a Hugging Face checkpoint: a directory holding
  `config.json`, or the path of such a JSON file (`ModelSpec.from_hf_config`; a directory's
  spec is named after it). A preset's name wins over a directory of that name (`./qwen3-8b`
  is the directory). The error lists what is allowed."""
  if isinstance(name, str) and name.lower() in MODELS:
    return MODELS[name.lower()]
  path = pathlib.Path(name) if isinstance(name, (str, pathlib.Path)) else None
  if path is not None and (path.is_dir() or path.suffix == ".json"):
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
      raise ConfigError(f"model {str(name)!r}: {file} does not exist (a checkpoint directory "
                        "holds config.json)")
    hf = read_object(file, ConfigError, "pass a checkpoint's config.json")
    label = (path if path.is_dir() else path.parent if path.name == "config.json"
             else path.with_suffix(""))
    return ModelSpec.from_hf_config(hf, pathlib.Path(os.path.abspath(label)).name)
  raise ConfigError(f"model {name!r} is unknown: allowed {', '.join(MODELS)}, or a checkpoint "
                    "directory with a config.json")


def default_draft_model(target: str) -> ModelSpec:
  """The draft model for a target preset (Qwen3 targets: qwen3-0.6b); a checkpoint's model
  has none (its family cannot be told from its directory's name)."""
  name = DEFAULT_DRAFT_MODEL.get(target, "qwen3-0.6b" if target.startswith("qwen3") else None)
  if name is None:
    raise ConfigError(f"no default draft model for {target!r}: pass one of {', '.join(MODELS)} "
                      "or a checkpoint directory")
  return MODELS[name]
