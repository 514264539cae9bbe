"""`run_drafter_training` end to end on tiny targets: the exported head loads and drafts
losslessly, a rerun resumes from the latest checkpoint and reproduces the steps it redoes,
the HF-checkpoint + GSM8K path runs, and bad configs fail early, naming the field."""

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, processors

from specjax.cli import main
from specjax.decoding import DraftTree, Eagle3Drafter, Eagle3Weights, SamplingConfig, generate
from specjax.errors import CheckpointError, ConfigError
from specjax.experiments import (Checkpointing, DistillData, Eagle3Head, HeadEvaluation,
                                 Optimization, WarmStart, override)
from specjax.experiments.drafter import (DrafterTrainConfig, load_target, run_drafter_training,
                                         task_prompts)
from specjax.models import ModelConfig, init_params, load_eagle3, save_hf
from specjax.rl import ArithmeticTask

TASK = ArithmeticTask(max_digits=1, num_operands=2, operators="+-", num_train=300, num_test=40,
                      test_fraction=0.3)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODEL = ModelConfig(vocab_size=TASK.tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=2,
                    n_kv_heads=1, head_dim=16, mlp_dim=64, max_position=32)


def _tiny(run_dir, changes: dict | None = None, **fields) -> DrafterTrainConfig:
  """Seconds, not minutes: a 2-layer d=32 policy after 30 warm-start steps (answers that run
  on, so responses are long enough to draft), 6 head steps of 2 TTT steps, chains of 2 in the
  evaluation. Compilation is most of the time: greedy data of 32 prompts and the greedy plain
  evaluation on 32 prompts of the same length are one program."""
  base = DrafterTrainConfig(
      run_dir=str(run_dir), task=TASK, model=MODEL,
      warm_start=WarmStart(steps=30, batch=16, eos_fraction=0.0),
      data=DistillData(num_prompts=32, max_new_tokens=8, generation_batch=32, temperature=0.0),
      head=Eagle3Head(draft_vocab_size=14, ttt_steps=2), steps=6, batch_size=8,
      optim=Optimization(learning_rate=3e-3, warmup_steps=1, final_lr_fraction=0.1),
      checkpoint=Checkpointing(every=3, keep=3),
      eval=HeadEvaluation(prompts=32, temperature=1.0, depth=2, speedup_repeats=1))
  return override(base, (changes or {}) | fields)


def _metrics(run_dir) -> list[dict]:
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("eagle3") / "run"
  config = _tiny(run_dir)
  logs = []
  summary = run_drafter_training(config, log=logs.append)
  return {"config": config, "summary": summary, "logs": logs, "dir": run_dir,
          "metrics": _metrics(run_dir)}


@pytest.mark.slow
def test_tiny_run_exports_a_head_that_loads_and_drafts_losslessly(tiny_run):
  config, summary, run_dir = tiny_run["config"], tiny_run["summary"], tiny_run["dir"]
  assert summary["steps"] == summary["steps_this_run"] == 6
  assert summary["greedy_equals_plain"] is True
  assert summary["acceptance_greedy"] >= 1.0 and summary["acceptance_sampled"] >= 1.0
  assert json.loads((run_dir / "summary.json").read_text()) == summary
  metrics = tiny_run["metrics"]
  assert [m["step"] for m in metrics] == list(range(1, 7))
  assert all(len(m["ce"]) == len(m["accuracy"]) == config.head.ttt_steps for m in metrics)
  assert all(np.isfinite(m["loss"]) for m in metrics)

  target = load_target(config)  # the warm-started policy, restored from run_dir/target
  head_config, params, d2t = load_eagle3(run_dir / "eagle3", target.config)
  assert head_config.draft_vocab_size == 14
  with np.load(run_dir / "data.npz") as data:
    np.testing.assert_array_equal(d2t, data["d2t"])
  tokens, lengths = task_prompts(config, target.tokenizer, "test", config.eval.prompts)
  run = lambda **kw: generate(target.params, target.config, tokens, lengths, jax.random.key(0),
                              max_new_tokens=8, sampling=SamplingConfig(0.0),
                              eos_id=target.tokenizer.eos_id, pad_id=target.tokenizer.pad_id,
                              **kw)
  plain = run()
  spec = run(drafter=Eagle3Drafter(head_config), tree=DraftTree.chain(config.eval.depth),
             drafter_params=Eagle3Weights(params, d2t))
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  assert float(spec.stats.tokens_per_round) > 1.0  # drafts are accepted, not just verified


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_rerun_after_a_kill_resumes_from_the_latest_checkpoint_and_redoes_only_later_steps(
    tiny_run, tmp_path):
  run_dir = tmp_path / "run"
  shutil.copytree(tiny_run["dir"], run_dir)
  # A kill after step 6 was logged but before its checkpoint: only step 3 is saved.
  shutil.rmtree(run_dir / "checkpoints" / "6")
  logs = []
  summary = run_drafter_training(_tiny(run_dir), log=logs.append)
  assert any("at step 3" in line for line in logs), logs
  assert any("warm-started policy saved in" in line for line in logs)  # target and data
  assert any("data: reusing" in line for line in logs)                 # are reused
  assert summary["steps"] == 6 and summary["steps_this_run"] == 3
  metrics, original = _metrics(run_dir), tiny_run["metrics"]
  assert [m["step"] for m in metrics] == list(range(1, 7))
  assert metrics[:3] == original[:3]  # steps before the checkpoint are not redone
  for redone, first in zip(metrics[3:], original[3:]):  # later ones are redone identically
    np.testing.assert_allclose(redone["loss"], first["loss"], rtol=1e-6)
    np.testing.assert_allclose(redone["ce"], first["ce"], rtol=1e-6)

  with pytest.raises(ConfigError, match=r"^data.num_prompts changed .*32 -> 16"):
    run_drafter_training(_tiny(run_dir, {"data.num_prompts": 16}), log=logs.append)


def _hf_target(directory):
  """A random HF checkpoint of `MODEL`'s architecture with a 17-word tokenizer (the ids of
  PAD, BOS and EOS as in the arithmetic tokenizer), and GSM8K-format data whose prompts have
  the arithmetic prompts' length: the run compiles the programs of the tiny run once."""
  words = [str(d) for d in range(10)] + ["plus", "minus", "apples"]
  vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + words)}
  raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  # Llama's way: the post-processor puts the BOS first (what transformers, and so specjax's
  # prompts, start with; tokenizer_config.json's bos_token alone adds none).
  raw.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                     special_tokens=[("<s>", 1)])
  directory.mkdir()
  raw.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "</s>", "pad_token": "<pad>", "bos_token": "<s>"}))
  assert len(vocab) == MODEL.vocab_size
  save_hf(init_params(MODEL, jax.random.key(0)), MODEL, directory)
  rng = np.random.default_rng(0)
  lines = []
  for _ in range(160):
    a, b, minus = rng.integers(0, 10), rng.integers(0, 10), rng.random() < 0.5
    lines.append(json.dumps({"question": f"{a} {'minus' if minus else 'plus'} {b} apples",
                             "answer": f"#### {a - b if minus else a + b}"}))
  (directory / "gsm8k.jsonl").write_text("\n".join(lines) + "\n")
  return directory


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_hf_checkpoint_target_with_gsm8k_prompts_runs_end_to_end(tmp_path):
  target_dir = _hf_target(tmp_path / "hf")
  config = _tiny(tmp_path / "run", {"data.gsm8k_file": str(target_dir / "gsm8k.jsonl"),
                                    "data.gsm8k_test_fraction": 0.5,
                                    "data.prompt_template": "{question}",
                                    "optim.warmup_steps": 0},
                 target_dir=str(target_dir), steps=2)
  logs = []
  summary = run_drafter_training(config, log=logs.append)
  assert summary["greedy_equals_plain"] is True
  assert any("data: 32 sequences of 13 tokens" in line for line in logs), logs
  assert not (tmp_path / "run" / "target").exists()  # an HF target is not copied
  assert load_eagle3(tmp_path / "run" / "eagle3")[0].aux_layers == (1, 1, 1)


def test_target_rl_run_restores_the_policy_of_a_specjax_train_checkpoint(tmp_path):
  from specjax.checkpoint import Checkpointer
  from specjax.experiments import Drafting, ExperimentConfig
  from specjax.rl.state import init_train_state
  rl = ExperimentConfig(task=TASK, model=MODEL, drafter=Drafting(name="none"))
  params = init_params(MODEL, jax.random.key(5))
  ckpt = Checkpointer(tmp_path / "rl" / "checkpoints")
  ckpt.save(4, init_train_state(rl.train_config(), params, rl.optimizer(), 0), {"step": 4})
  ckpt.close()
  target = load_target(_tiny(tmp_path / "run", target_rl_run=str(tmp_path / "rl")))
  jax.tree.map(np.testing.assert_array_equal, target.params, params)
  with pytest.raises(ConfigError, match=r"^target_rl_run=.*params\['embed'\]"):
    load_target(_tiny(tmp_path / "run", target_rl_run=str(tmp_path / "rl"),
                      model=MODEL.replace(d_model=64)))
  # A flipped byte in a saved array is caught by the run's digest, not trained against.
  from specjax.checkpoint import DIGEST_FILE
  step_dir = tmp_path / "rl" / "checkpoints" / "4"
  data = max((p for p in step_dir.rglob("*") if p.is_file() and p.name != DIGEST_FILE),
             key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0xFF
  data.write_bytes(bytes(raw))
  with pytest.raises(CheckpointError, match=r"checkpoint step 4 at .* is corrupted"):
    load_target(_tiny(tmp_path / "run", target_rl_run=str(tmp_path / "rl")))


@pytest.mark.parametrize("changes, field", [
    (dict(steps=0), "steps"),
    ({"head.ttt_steps": 0}, "head.ttt_steps"),
    ({"data.temperature": -1.0}, "data.temperature"),
    ({"optim.warmup_steps": 6}, "optim.warmup_steps"),
    ({"optim.learning_rate": 0.0}, "optim.learning_rate"),
    ({"head.draft_vocab_size": 18}, "head.draft_vocab_size"),
    ({"head.aux_layers": (1, 2, 3)}, "aux_layers"),
    (dict(model=MODEL.replace(vocab_size=20)), "model"),
    (dict(target_dir="hf", target_rl_run="runs/rl"), "target_rl_run"),
    ({"data.gsm8k_file": "train.jsonl", "data.gsm8k_test_fraction": 0.0},
     "data.gsm8k_test_fraction"),
    ({"warm_start.eos_fraction": 1.5}, "warm_start.eos_fraction"),
    ({"eval.depth": 0}, "eval.depth"),
])
def test_invalid_configs_raise_config_errors_naming_the_field(tmp_path, changes, field):
  with pytest.raises(ConfigError, match=rf"^{re.escape(field)}=.* is invalid"):
    _tiny(tmp_path, changes)


@pytest.mark.parametrize("changes, field", [
    ({"data.max_new_tokens": 40}, "data.max_new_tokens"),
    ({"eval.max_new_tokens": 40}, "eval.max_new_tokens"),
    ({"eval.prompts": 41}, "eval.prompts"),
    (dict(target_dir="no/such/dir"), "target_dir"),
    (dict(target_rl_run="no/such/run"), "target_rl_run"),
])
def test_configs_that_do_not_fit_the_target_fail_before_any_training(tmp_path, changes,
                                                                     field):
  with pytest.raises(ConfigError, match=rf"^{re.escape(field)}=.* is invalid"):
    run_drafter_training(_tiny(tmp_path / "run", changes), log=lambda line: None)
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_train_drafter_applies_overrides_to_the_config_file(monkeypatch, tmp_path):
  seen = []
  monkeypatch.setattr("specjax.experiments.drafter.run_drafter_training",
                      lambda config: seen.append(config) or {})
  main(["train-drafter", "--config", str(CONFIGS / "eagle3_arithmetic.py"), "--run-dir",
        str(tmp_path), "--steps", "70", "--head.ttt-steps", "2", "--head.aux-layers", "1", "1",
        "1"])
  assert (seen[0].steps, seen[0].head.ttt_steps, seen[0].head.aux_layers) == (70, 2, (1, 1, 1))
  assert seen[0].run_dir == str(tmp_path) and seen[0].head.draft_vocab_size == 15
  with pytest.raises(SystemExit, match="needs a DrafterTrainConfig"):
    main(["train-drafter", "--config", str(CONFIGS / "arithmetic_tiny.py")])


def test_a_rerun_names_a_damaged_data_file_and_tolerates_a_metrics_line_cut_by_a_kill(
    tmp_path):
  """What `train-drafter` reads back from its run directory: `data.npz` truncated, foreign or
  inconsistent is refused naming the file; a `metrics.jsonl` whose last line a kill cut short
  loses that line (the step runs again), while a malformed earlier line or one without a step
  is named (the shared reader of `specjax train`)."""
  from specjax.experiments.drafter import _read_data
  from specjax.experiments.run_record import kept_metrics
  good = tmp_path / "data.npz"
  tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
  np.savez(good, tokens=tokens, loss_mask=np.ones_like(tokens), d2t=np.arange(5))
  np.testing.assert_array_equal(_read_data(good)[0], tokens)
  cut = tmp_path / "cut.npz"
  cut.write_bytes(good.read_bytes()[:100])
  foreign = tmp_path / "foreign.npz"
  np.savez(foreign, weights=np.zeros(3))
  wrong = tmp_path / "wrong.npz"
  np.savez(wrong, tokens=tokens.astype(np.float32), loss_mask=np.ones_like(tokens),
           d2t=np.arange(5))
  for path, message in ((cut, "cannot be read as this run's data"),
                        (foreign, "cannot be read as this run's data \\(KeyError"),
                        (wrong, "holds tokens \\(3, 4\\) float32")):
    with pytest.raises(CheckpointError, match=rf"{path.name} {message}"):
      _read_data(path)

  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
  logs = []
  assert kept_metrics(metrics, 2, logs.append) == ['{"step": 1, "loss": 2.0}',
                                                   '{"step": 2, "loss": 1.5}']
  assert "dropped the truncated last line 3" in logs[0]
  metrics.write_text('{"step": 1, "lo\n{"step": 2, "loss": 1.5}\n')
  with pytest.raises(CheckpointError, match="line 1 is not a JSON record"):
    kept_metrics(metrics, 2)
  metrics.write_text('{"loss": 1.5}\n{"step": 2}\n')
  with pytest.raises(CheckpointError, match='line 1 has no integer "step"'):
    kept_metrics(metrics, 2)
