"""Checkpoints named by Hugging Face Hub id: `Qwen/Qwen3-0.6B` resolved to a local directory.

Wherever specjax takes an HF checkpoint directory (`load_hf`, `HFTokenizer.from_dir`,
`ExperimentConfig.policy_dir`, `--drafter.checkpoint`, `specjax generate --checkpoint`), a
path that is not a local directory but has the form of a Hub id (`owner/name`) is fetched
with `huggingface_hub.snapshot_download` — config, safetensors, tokenizer and chat-template
files only — into the Hub's local cache, and the snapshot's directory is used. With
`HF_HUB_OFFLINE=1` (or no network) a model already in the cache resolves without a request;
one that is not fails with a message saying so. `huggingface_hub` is the optional extra
`specjax[hub]` (transformers installs it too).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from specjax.errors import ConfigError

# What a model directory is made of: weights, configs, tokenizer files, chat templates.
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model")

# `owner/name`: Hub ids allow letters, digits, "-", "_" and "." (not leading, no "--" or "..").
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def is_hub_id(source: str | os.PathLike) -> bool:
  """Whether `source` has the form of a Hub model id (a local path may too: check it first)."""
  text = os.fspath(source)
  return bool(_REPO_ID.match(text)) and ".." not in text and "--" not in text


def local_checkpoint(source: str | os.PathLike, field: str = "checkpoint") -> Path:
  """`source` as a local directory: itself when it is one (or any path that is not a Hub id,
  for the caller's own missing-file message), else the Hub model's local snapshot.

  Raises:
    ConfigError: a Hub id without `huggingface_hub` installed, or one the Hub (or, offline,
      the cache) cannot provide; messages name `field`.
  """
  path = Path(source).expanduser()
  if path.exists() or not is_hub_id(source):
    return path
  try:
    import huggingface_hub
  except ImportError:
    raise ConfigError(f"{field}={os.fspath(source)!r} is not a local directory; to fetch it as a "
                      "Hugging Face Hub model, pip install 'specjax[hub]'") from None
  try:
    return Path(huggingface_hub.snapshot_download(os.fspath(source), allow_patterns=HUB_FILES))
  except Exception as err:  # offline and not cached, unknown repo, gated, no network, ...
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    hint = (" (HF_HUB_OFFLINE is set and the model is not in the local Hub cache)" if offline
            else "")
    raise ConfigError(f"{field}={os.fspath(source)!r} is neither a local directory nor a "
                      f"Hugging Face Hub model this machine can fetch{hint}: "
                      f"{type(err).__name__}: {err}") from None
