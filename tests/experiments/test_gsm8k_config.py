"""configs/gsm8k_chat.py, the GSM8K run with a chat checkpoint (issue 55): its inputs are
checked when the config is built, and it trains on a tiny random chat checkpoint and
GSM8K-format files written here (no network, no ../shared)."""

import json
import runpy

import pytest

from specjax.cli import main as cli_main
from specjax.errors import ConfigError
from support import ROOT, write_hf_checkpoint

CONFIG = ROOT / "configs" / "gsm8k_chat.py"


def questions(count: int, offset: int = 0) -> list[dict]:
  return [{"question": f"Tom has {a} apples and buys {a + 2} more. How many apples now?",
           "answer": f"He has {a} + {a + 2} = {2 * a + 2} apples.\n#### {2 * a + 2}"}
          for a in range(offset, offset + count)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  """A tiny chat checkpoint (tokenizer trained on the questions) and GSM8K's two files."""
  root = tmp_path_factory.mktemp("gsm8k")
  data = root / "gsm8k"
  data.mkdir()
  train, test = questions(24), questions(8, offset=30)
  for name, rows in (("train", train), ("test", test)):
    (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  texts = [r["question"] + r["answer"] for r in train + test] + ["\\boxed{12} step by step"] * 5
  return write_hf_checkpoint(root / "chat", texts), data


def config_with(monkeypatch, policy, data):
  monkeypatch.setenv("SPECJAX_POLICY", str(policy))
  monkeypatch.setenv("SPECJAX_GSM8K", str(data))
  return runpy.run_path(str(CONFIG))["get_config"]()


def test_the_config_renders_questions_as_chat_turns_rewarded_by_math_verify(inputs,
                                                                          monkeypatch):
  policy, data = inputs
  config = config_with(monkeypatch, policy, data)
  task = config.task
  assert [r.name for r in task.rewards] == ["math_answer"] and not task.reward_in_jax
  assert len(task.examples("train")) == 24 and len(task.examples("test")) == 8
  prompt = task.examples("test")[0].prompt
  assert prompt.startswith("<|im_start|>user\nTom has 30 apples") and "\\boxed{}" in prompt
  assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
  assert config.pipeline.async_mode and config.rewards.kind == "process"


def test_missing_data_or_a_checkpoint_without_chat_template_is_refused(inputs, monkeypatch,
                                                                       tmp_path):
  policy, data = inputs
  with pytest.raises(ConfigError, match=r"SPECJAX_GSM8K='.*nowhere' is invalid: it has no "
                                        r"train.jsonl"):
    config_with(monkeypatch, policy, tmp_path / "nowhere")
  with pytest.raises(ConfigError, match=r"SPECJAX_POLICY='.*nothing' is invalid: no "
                                        r"tokenizer.json there"):
    config_with(monkeypatch, tmp_path / "nothing", data)
  plain = write_hf_checkpoint(tmp_path / "plain", [], tokenizer_from=policy)
  settings = json.loads((plain / "tokenizer_config.json").read_text())
  settings.pop("chat_template", None)
  (plain / "tokenizer_config.json").write_text(json.dumps(settings))
  for template in plain.glob("chat_template.*"):
    template.unlink()
  with pytest.raises(ConfigError, match="its tokenizer has no chat template"):
    config_with(monkeypatch, plain, data)


@pytest.mark.slow  # a two-step run: about a minute on 2 cores
def test_the_config_trains_two_async_steps_on_a_tiny_chat_checkpoint(inputs, monkeypatch,
                                                                     tmp_path):
  policy, data = inputs
  monkeypatch.setenv("SPECJAX_POLICY", str(policy))
  monkeypatch.setenv("SPECJAX_GSM8K", str(data))
  run_dir = tmp_path / "run"
  cli_main(["train", "--config", str(CONFIG), "--run-dir", str(run_dir), "--steps", "2",
            "--policy-dtype", "float32", "--lora.rank", "4", "--lora.alpha", "8",
            "--rollout.prompts-per-step", "2", "--rollout.max-new-tokens", "8",
            "--grpo.group-size", "4", "--grpo.num-minibatches", "2",
            "--drafter.name", "ngram",  # the EAGLE-3 distillation is tested elsewhere
            "--rewards.workers", "2", "--eval.prompts", "4", "--eval.speedup-repeats", "1",
            "--eval.speedup-seconds", "0"])
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2]
  for record in records:
    assert 0.0 <= record["reward_math_answer"] <= 1.0 and record["perf_reward_s"] > 0
  assert (run_dir / "summary.json").is_file()
