"""Every error specjax raises on purpose, in one place.

Each message names what is wrong and what is allowed, so a caller can fix the input without
reading the library. All derive from `SpecjaxError`, so `except SpecjaxError` catches
exactly the failures specjax diagnosed (and nothing from a dependency).
"""

from __future__ import annotations


class SpecjaxError(Exception):
  """Base class of the errors specjax raises deliberately."""


class ConfigError(SpecjaxError, ValueError):
  """A configuration value that cannot work; the message names the field and what is allowed."""


class CheckpointError(SpecjaxError, ValueError):
  """A checkpoint that cannot be used: a missing or unreadable file or directory, a missing,
  unexpected or misshapen tensor, or a step that cannot be restored. The message names the
  file, tensor or step and what to do."""


class TokenizerError(SpecjaxError, ValueError):
  """Text, an id or a tokenizer directory that cannot be used; the message names it."""


class TaskError(SpecjaxError, ValueError):
  """Task data that cannot be used (a malformed JSONL line, ...); the message locates it."""


class RewardError(SpecjaxError, RuntimeError):
  """A Python reward function raised or returned a non-finite value; names task and sample."""


class StorageError(SpecjaxError, OSError):
  """A file a run writes that cannot be written (a full disk, a read-only file system, a
  vanished directory); the message names the file and the cause, and what was kept."""


class RunDirectoryInUse(SpecjaxError, RuntimeError):
  """A run directory that another live process owns; the message names its host and pid."""
