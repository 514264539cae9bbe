"""A resume notices changed data and rewards (`specjax.experiments.run_inputs`): rewritten rows
at the same path, another reward weight, an edited reward function, one added or removed.
Each is refused naming it, and accepted with `accept_changed_inputs`, which records it."""

import json

import pytest
from support import tiny_experiment

from specjax.errors import ConfigError
from specjax.experiments.grpo import run
from specjax.experiments.run_inputs import INPUTS_FILE, check_inputs
from specjax.rl.datasets import DatasetTask
from specjax.rl.rewards import RewardFunction
from specjax.tokenizer import CharTokenizer

TOK = CharTokenizer("abcdefghij +=0123456789")
ROWS = [{"prompt": f"{i}+{j}=", "answer": str(i + j)} for i in range(5) for j in range(4)]


def exact(prompts, completions, answer):
  return [float(c.strip() == a) for c, a in zip(completions, answer)]


def exact_edited(prompts, completions, answer):  # the same name below: only its code differs
  return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]


def short(prompts, completions, answer):
  return [-0.01 * len(c) for c in completions]


def _task(path, rewards=(exact,)):
  return DatasetTask(str(path), TOK, list(rewards), test_fraction=0.25)


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _started(tmp_path, task):
  """A run directory that recorded `task`'s inputs and holds a checkpoint."""
  run_dir = tmp_path / "run"
  (run_dir / "checkpoints" / "1").mkdir(parents=True)
  check_inputs(run_dir, task, started=False, accept=False, write=True, log=print)
  assert (run_dir / INPUTS_FILE).is_file()
  return run_dir


@pytest.mark.parametrize("change, message", [
    (lambda p: (_write(p, ROWS[:-1]), (exact,)),
     r"split's rows: \d+ -> \d+ rows"),
    (lambda p: (_write(p, ROWS[::-1]), (exact,)), r"rows \(same count, other contents or order\)"),
    (lambda p: (p, (RewardFunction(exact, weight=2.0),)), r"reward 'exact''s weight 1.0 -> 2.0"),
    (lambda p: (p, (RewardFunction(exact_edited, name="exact"),)),
     r"reward 'exact''s source code"),
    (lambda p: (p, (exact, short)), r"reward 'short' added"),
])
def test_a_resume_on_changed_inputs_is_refused_naming_the_change_and_accepted_with_the_flag(
    tmp_path, change, message):
  path = _write(tmp_path / "rows.jsonl", ROWS)
  run_dir = _started(tmp_path, _task(path))
  check_inputs(run_dir, _task(path), started=True, accept=False, write=True, log=print)  # same
  path, rewards = change(path)
  changed = _task(path, rewards)
  with pytest.raises(ConfigError, match=r"started on other inputs: .*" + message):
    check_inputs(run_dir, changed, started=True, accept=False, write=True, log=print)
  said = []
  check_inputs(run_dir, changed, started=True, accept=True, write=True, log=said.append)
  assert said and said[0].startswith("resuming with changed inputs (accept_changed_inputs): ")
  # Recorded: the next resume on the same inputs goes on without a word.
  check_inputs(run_dir, changed, started=True, accept=False, write=True, log=said.append)
  assert len(said) == 1


def test_a_run_refuses_changed_rows_before_it_builds_anything(tmp_path):
  path = _write(tmp_path / "rows.jsonl", ROWS)
  old = _task(path)
  run_dir = _started(tmp_path, old)
  _write(path, [{"prompt": "0+0=", "answer": "1"}] + ROWS[1:])  # one answer edited
  changes = {"run_dir": str(run_dir), "task": _task(path),
             "model.vocab_size": TOK.vocab_size}
  with pytest.raises(ConfigError, match=r"split's rows \(same count, other contents or "
                                        r"order\) changed since.*--accept-changed-inputs"):
    run(tiny_experiment(run_dir, changes))
