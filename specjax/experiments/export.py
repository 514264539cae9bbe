"""A `specjax train` run directory read back: its policy, and an HF export of it.

    params, model = load_policy("runs/arithmetic_worked")
    specjax export runs/arithmetic_worked exported/   # HF weights + tokenizer (+ EAGLE-3 head)

`load_policy` restores the policy of the run's latest checkpoint (verified against the
digest the run recorded when it saved), its architecture read from the run's `config.json`
(a LoRA run's policy: the frozen trunk with its trained adapters merged in). `export_run`
writes it as an HF checkpoint directory that transformers and `load_hf` load: the weights
(and MTP / Medusa heads, which transformers ignores), `config.json` with the tokenizer's
special ids, the tokenizer files, and, for a run that trained an EAGLE-3 head to its end,
that head in the layout vLLM and SGLang load (`OUT/eagle3`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from specjax.checkpoint import Checkpointer
from specjax.errors import CheckpointError, ConfigError
from specjax.experiments.run_record import CONFIG_FILE
from specjax.files import read_object, write_text_atomic
from specjax.models import ModelConfig, init_params, load_eagle3, load_hf, save_eagle3, save_hf
from specjax.models.config import Llama3RopeScaling
from specjax.models.lora import LoraAdapters, LoraConfig
from specjax.models.params import Params
from specjax.rl.tasks import ArithmeticTask
from specjax.tokenizer import CharTokenizer, HFTokenizer


def recorded_config(run_dir: str | Path) -> dict[str, Any]:
  """The config a `specjax train` run recorded when it started (`config.json`), as JSON."""
  path = Path(run_dir) / CONFIG_FILE
  if not path.is_file():
    raise ConfigError(f"run_dir={str(run_dir)!r} is invalid: no {CONFIG_FILE} there (a "
                      "`specjax train` run directory records one when it starts)")
  record = read_object(path, CheckpointError, "restore the run's config.json from a copy")
  if not isinstance(record.get("model"), dict):
    raise CheckpointError(f"{path} holds no model config (a \"model\" object)")
  return record


def recorded_model(record: dict[str, Any]) -> ModelConfig:
  """The policy's architecture in a recorded config."""
  fields = dict(record["model"])
  if isinstance(fields.get("rope_scaling"), dict):
    fields["rope_scaling"] = Llama3RopeScaling(**fields["rope_scaling"])
  try:
    return ModelConfig(**fields)
  except TypeError as err:  # a field this version does not know (or lacks)
    raise CheckpointError(f"the recorded model config does not fit this specjax's ModelConfig "
                          f"({err})") from None


# What an HF model directory's tokenizer is made of (copied into an export).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def recorded_tokenizer(record: dict[str, Any], where: Path) -> CharTokenizer | HFTokenizer:
  """The policy's tokenizer in a recorded config: an HF tokenizer by the directory it was
  loaded from, a character tokenizer by its alphabet, or the built-in task's."""
  task = record.get("task")
  if not isinstance(task, dict):
    raise CheckpointError(f"{where} holds no task config (a \"task\" object): the tokenizer "
                          "cannot be exported")
  tok = task.get("tokenizer")
  if isinstance(tok, dict) and tok.get("source") is not None:
    source = Path(tok["source"])
    if not (source / "tokenizer.json").is_file():
      raise CheckpointError(f"{where}: the run's tokenizer came from {source}, which holds no "
                            "tokenizer.json any more; restore it to export the tokenizer")
    return HFTokenizer.from_dir(source)
  if isinstance(tok, dict) and "alphabet" in tok:
    return CharTokenizer(tok["alphabet"])
  try:
    return ArithmeticTask(**task).tokenizer
  except TypeError as err:
    raise CheckpointError(f"{where}: the run's tokenizer cannot be told from its task record "
                          f"({err})") from None


def load_policy(run_dir: str | Path, model: ModelConfig | None = None, *,
                field: str = "run_dir") -> tuple[Params, ModelConfig]:
  """The policy parameters of the latest checkpoint of a `specjax train` run, and its
  architecture (`model`, or the one the run recorded).

  `run_dir` may also be the run's `checkpoints/` directory. The step is verified against its
  digest before a byte is read; only the parameters are restored, whatever else the train
  state holds (optimizer moments, a pending rollout, an EAGLE-3 head).

  Raises:
    ConfigError: no such directory, no checkpoint, or a policy of another shape than `model`
      (messages name `field`).
    CheckpointError: a corrupted or unreadable step.
  """
  directory = Path(run_dir).absolute()
  if (directory / "checkpoints").is_dir():
    directory = directory / "checkpoints"
  if not directory.is_dir():
    raise ConfigError(f"{field}={str(run_dir)!r} is invalid: no such directory")
  if model is None:
    model = recorded_model(recorded_config(directory.parent))
  checked = Checkpointer(directory)
  try:
    step = checked.latest_step()
    if step is None:
      raise ConfigError(f"{field}={str(run_dir)!r} is invalid: {directory} holds no checkpoint")
    checked.verify(step)  # every file against the digest the run recorded when it saved
  finally:
    checked.close()
  manager = ocp.CheckpointManager(directory, item_names=("state", "meta"))
  try:  # the whole train state, as saved: only its params are needed, whatever else it holds
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  except Exception as err:  # orbax raises many types
    raise CheckpointError(f"checkpoint step {step} in {directory} cannot be restored "
                          f"({type(err).__name__}: {err})") from err
  finally:
    manager.close()
  params = state["state"]["params"]
  adapters = state["state"].get("adapters")
  if adapters is not None:  # a LoRA run: its policy is the frozen trunk with them merged
    params = _merged(params, adapters, directory.parent, field, run_dir)
  expected = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
  shapes = lambda tree: {jax.tree_util.keystr(k): (tuple(x.shape), str(x.dtype))
                         for k, x in jax.tree_util.tree_leaves_with_path(tree)}
  got, want = shapes(params), shapes(expected)
  if got != want:
    name = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))[0]
    raise ConfigError(f"{field}={str(run_dir)!r} is invalid with this model: the checkpoint's "
                      f"policy has params{name} {got.get(name, 'missing')}, the model "
                      f"{want.get(name, 'nothing')}; pass the RL run's architecture "
                      "(--model.*)")
  return jax.tree.map(jnp.asarray, params), model


def _merged(params: Params, adapters: dict[str, Any], run: Path, field: str,
            run_dir: str | Path) -> Params:
  """A LoRA run's restored trunk with its restored adapters merged in, by the `lora` config
  the run recorded (rank, alpha, targets)."""
  recorded = recorded_config(run).get("lora")
  try:
    config = LoraConfig(**recorded)
  except (TypeError, ConfigError) as err:
    raise CheckpointError(f"{field}={str(run_dir)!r}: the checkpoint holds LoRA adapters but "
                          f"the run's config.json records no usable lora config ({recorded!r}:"
                          f" {err})") from None
  factors = jax.tree.map(jnp.asarray, adapters["factors"])
  names = {name for layer in factors["layers"] for name in layer}
  adaptable = {name for name in config.targets if name in params["layers"][0]}  # MoE: attention
  if names != adaptable or len(factors["layers"]) != len(params["layers"]):
    raise CheckpointError(f"{field}={str(run_dir)!r}: the checkpoint's adapters ({sorted(names)}"
                          f", {len(factors['layers'])} layers) are not those of the recorded "
                          f"{config}")
  return LoraAdapters(factors=factors, config=config).merge(jax.tree.map(jnp.asarray, params))


def _write_tokenizer(tokenizer: CharTokenizer | HFTokenizer, out: Path) -> None:
  """The policy's tokenizer files into the model directory `out`: an HF tokenizer's own
  (its chat template included), or a character tokenizer as `tokenizer.json`."""
  if isinstance(tokenizer, HFTokenizer):
    source = Path(tokenizer.source)
    for name in TOKENIZER_FILES:
      if (source / name).is_file():
        write_text_atomic(out / name, (source / name).read_text())
  else:
    tokenizer.save(out)


def _check_apart(kept: Path, out: Path, what: str) -> None:
  """Refuse an `out` whose replacement would delete `kept` (the run directory, or the
  checkpoint the run started from): `kept` itself, a directory inside it or one that
  holds it."""
  keep, dest = kept.resolve(), out.resolve()
  if dest == keep or keep in dest.parents or dest in keep.parents:
    where = ("is" if dest == keep else "is inside" if keep in dest.parents else "holds")
    raise ConfigError(f"out={str(out)!r} is invalid: it {where} {what} {str(kept)!r}, and the "
                      "export replaces out whole; name a directory apart from it")


def export_run(run_dir: str | Path, out: str | Path,
               log: Callable[[str], None] = print) -> Path:
  """Write the latest policy of the `specjax train` run in `run_dir` to `out` as an HF
  checkpoint directory with its tokenizer, the run's final EAGLE-3 head (if it trained one to
  the end) to `out/eagle3`, and a draft model it distilled online to `out/draft_model`.
  Returns `out`, which must lie apart from the run directory and its `policy_dir`: `out` is
  replaced whole."""
  _check_apart(Path(run_dir), Path(out), "the run directory")
  record = recorded_config(run_dir)
  if record.get("policy_dir") is not None:  # its base weights: a resume or LoRA reads them
    _check_apart(Path(record["policy_dir"]), Path(out), "the run's policy_dir")
  model = recorded_model(record)
  params, _ = load_policy(run_dir, model)
  tokenizer = recorded_tokenizer(record, Path(run_dir) / CONFIG_FILE)
  out = Path(out)
  policy_dir = record.get("policy_dir")
  extra = None
  if policy_dir is not None and (Path(policy_dir) / "config.json").is_file():
    extra = json.loads((Path(policy_dir) / "config.json").read_text())  # its other HF fields
  eos = list(tokenizer.eos_ids) if len(getattr(tokenizer, "eos_ids", ())) > 1 else tokenizer.eos_id
  save_hf(params, model, out, extra_config=extra, bos_token_id=tokenizer.bos_id,
          eos_token_id=eos, pad_token_id=tokenizer.pad_id)
  _write_tokenizer(tokenizer, out)
  log(f"policy of {run_dir} -> {out} (HF {model.family} checkpoint with its tokenizer)")
  draft = Path(run_dir) / "draft_model"
  if draft.is_dir():  # a draft model distilled online (`drafter.draft_model_learning_rate`)
    draft_params, draft_config = load_hf(draft, param_dtype="auto")
    save_hf(draft_params, draft_config, out / "draft_model", bos_token_id=tokenizer.bos_id,
            eos_token_id=eos, pad_token_id=tokenizer.pad_id)
    _write_tokenizer(tokenizer, out / "draft_model")
    log(f"the draft model distilled during the run -> {out / 'draft_model'}")
  head = Path(run_dir) / "eagle3"
  if head.is_dir():
    config, head_params, d2t = load_eagle3(head, model)
    save_eagle3(out / "eagle3", head_params, config, d2t)
    log(f"EAGLE-3 head of the run's end -> {out / 'eagle3'} (the layout vLLM and SGLang load)")
  return out
