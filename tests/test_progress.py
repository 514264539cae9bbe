"""No long silence: every phase of a command that lasts more than a few seconds is announced
(a line saying what runs) or shows a progress bar, so a user watching `specjax train`,
`specjax generate --adaptive` or `specjax plan` always knows what it is doing.

Each command runs as a user runs it, its output read as it comes (lines and progress-bar
redraws, timestamped); wherever the output pauses for more than `PAUSE_S`, the last thing
written must be an announcement or a progress bar, never a result. The check does not depend
on how fast the machine is: a slow machine makes more pauses, each still announced.
"""

import os
import re
import subprocess
import sys
import time

import pytest
from support import ROOT, child_env

PAUSE_S = 5.0
# What a phase says when it starts (what it is doing, in the present), or an interim line of
# a running one ("step 25/100: ...").
ANNOUNCEMENT = re.compile(
    r"^(training|measuring|evaluating|compiling|distilling|loading|warm start|grpo|"
    r"calibrating|resumed|policy|draft model|EAGLE-3|speculation costs|held-out|"
    r"step \d+/\d+)", re.I)
BAR = re.compile(r"\d+%\|")  # a tqdm bar: "12%|█▏   | 12/100 [...]"


def _timed_output(command: list[str], timeout: float = 900) -> tuple[int, list]:
  """(exit status, [(seconds since start, line)]), each line or bar redraw when it arrived."""
  env = child_env(PYTHONUNBUFFERED="1")
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          cwd=ROOT)
  start, pending, events = time.monotonic(), b"", []
  while True:
    chunk = os.read(proc.stdout.fileno(), 65536)
    if not chunk:
      break
    now = time.monotonic() - start
    assert now < timeout, f"{command} ran past {timeout} s"
    *lines, pending = re.split(rb"[\r\n]", pending + chunk)
    events += [(now, line.decode(errors="replace").strip()) for line in lines if line.strip()]
  proc.wait()
  events.append((time.monotonic() - start, "<exit>"))
  return proc.returncode, events


def _unannounced_pauses(events: list) -> list[str]:
  return [f"{t1 - t0:.0f}s of silence after {line!r} (at {t0:.0f}s)"
          for (t0, line), (t1, _) in zip(events, events[1:])
          if t1 - t0 > PAUSE_S and not (ANNOUNCEMENT.search(line) or BAR.search(line))]


def _check(command: list[str]) -> list:
  status, events = _timed_output(command)
  text = "\n".join(f"{t:7.1f}  {line}" for t, line in events)
  assert status == 0, text[-4000:]
  assert not _unannounced_pauses(events), "\n".join(_unannounced_pauses(events)) + "\n" + text
  return events


@pytest.mark.slow
def test_a_short_train_run_announces_every_long_phase(tmp_path):
  events = _check([sys.executable, "-m", "specjax.cli", "train", "--config",
                   "configs/arithmetic_worked.py", "--run-dir", str(tmp_path / "run"),
                   "--steps", "3", "--warm-start.steps", "40", "--eval.prompts", "16",
                   "--eval.speedup-repeats", "1", "--eval.speedup-seconds", "0"])
  said = "\n".join(line for _, line in events)
  for phase in ("warm start", "measuring what a round", "evaluating the warm-started policy",
                "compiling the GRPO step", "evaluating the trained policy"):
    assert phase in said, phase
  # One repeat of each rollout arm: the run says so rather than print a ratio as a speedup.
  speedup = next(line for line in said.splitlines() if line.startswith("rollout speedup"))
  assert "too short to measure (1 repeat(s)" in speedup, speedup


@pytest.mark.slow
def test_adaptive_generation_and_plan_announce_their_long_phases():
  _check([sys.executable, "-m", "specjax.cli", "generate", "--demo", "--demo-steps", "100",
          "--adaptive", "--widths", "1", "1", "--max-new-tokens", "16"])
  _check([sys.executable, "-m", "specjax.cli", "plan", "--config", "configs/arithmetic_tiny.py",
          "--devices", "2"])


def test_the_check_finds_a_silent_phase():
  """Negative control: a pause after a result line is reported; after an announcement or a
  bar it is not."""
  events = [(0.0, "policy: 10 parameters"), (1.0, "held-out accuracy before RL: 0.5"),
            (9.0, "measuring what a round costs"), (20.0, "grpo:  50%|█████  | 1/2"),
            (30.0, "<exit>")]
  assert _unannounced_pauses(events) == []
  events.insert(2, (2.0, "the answer is 42"))
  assert _unannounced_pauses(events) == ["7s of silence after 'the answer is 42' (at 2s)"]
