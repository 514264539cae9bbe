"""A reward for code: each completion's program run against its row's tests, under limits.

`code_reward(tests_column="tests")` scores a completion 1 when its program passes the row's
tests, else 0: the program is the last fenced code block of the completion (```python ...```),
or the whole completion when it has none; the tests are Python (`assert`s, or a `check()` call
as HumanEval's), appended to the program and run in a fresh interpreter. A row's tests may
also be a list of such snippets: the reward is then the fraction that pass, each run with the
program apart. A row whose tests are empty (None, "", []) is not scored (None).

Each run happens in a new, empty temporary directory, removed afterwards, with an environment
of PATH alone, in `python -I` (no user site, no PYTHON* variables), and under limits set by the
kernel: CPU seconds (`cpu_s`), address space (`memory_mb`), bytes written to any file,
standard output and error included (`output_kb`), 64 open files, no core dumps; the wall clock
(`timeout_s`) kills it past its limit. An audit hook refuses sockets and the creation of
processes (a fork bomb's `os.fork` fails at once); where the system allows an unprivileged
user and network namespace (`unshare -rn`, Linux), the run also has no network interface at
all. A program that breaks a limit, or is refused, scores 0 like a failing one; the run goes
on. This is a guard against the accidents of generated code (loops, runaway memory or output,
stray network calls), not a security boundary against code written to escape (ctypes can
reach the C library): for that, run the reward in a container sandbox.

No well-kept Python library runs untrusted code without a container or root (epicbox and
llm-sandbox drive Docker, nsjail and firejail are system binaries, RestrictedPython restricts
the language rather than the process), so this uses the standard library's `resource` and
`sys.addaudithook`, and util-linux's `unshare` where present.

The programs of a batch run one after another in the calling thread; `--rewards.workers N`
(threads: each run waits on its subprocess) runs N at once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from specjax.checks import require_ints, require_reals
from specjax.errors import ConfigError
from specjax.rl.rewards import TEXT_ARGUMENTS, RewardFunction

_PRELUDE = Path(__file__).with_name("_sandbox_prelude.py")
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(completion: str) -> str:
  """The program in a completion: its last fenced code block, else the whole text."""
  blocks = _FENCE.findall(completion)
  return blocks[-1] if blocks else completion


@dataclasses.dataclass(frozen=True)
class RunResult:
  """How one run ended.

  Attributes:
    passed: it exited 0 within the limits.
    status: "passed", "failed" (a non-zero exit: an assertion, an exception), "timeout" (wall
      clock or CPU), "memory", "output" (wrote more than allowed) or "refused" (a socket or a
      new process).
    detail: the end of its standard error.
  """

  passed: bool
  status: str
  detail: str = ""


@dataclasses.dataclass(frozen=True)
class CodeLimits:
  """What one run may use (module docstring)."""

  timeout_s: float = 10.0
  cpu_s: int = 10
  memory_mb: int = 1024
  output_kb: int = 1024

  def __post_init__(self):
    require_reals(self, ("timeout_s",), positive=True, prefix="code_reward: ")
    require_ints(self, ("cpu_s",), 1, "code_reward: ")
    require_ints(self, ("memory_mb",), 64, "code_reward: ")
    require_ints(self, ("output_kb",), 1, "code_reward: ")


@functools.cache
def network_namespace() -> tuple[str, ...]:
  """The command prefix that runs a program without network (an unprivileged user and
  network namespace), or () where the system does not allow one."""
  unshare = shutil.which("unshare")
  if unshare is None or not sys.platform.startswith("linux"):
    return ()
  prefix = (unshare, "--user", "--map-root-user", "--net")
  try:
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return ()
  return prefix if probe.returncode == 0 else ()


def run_program(source: str, limits: CodeLimits = CodeLimits()) -> RunResult:
  """Run `source` as a Python program under `limits` (module docstring)."""
  with tempfile.TemporaryDirectory(prefix="specjax-code-") as work:
    program = Path(work) / "program.py"
    program.write_text(source)
    out, err = Path(work) / "stdout", Path(work) / "stderr"
    command = [*network_namespace(), sys.executable, "-I", str(_PRELUDE), str(limits.cpu_s),
               str(limits.memory_mb * 2**20), str(limits.output_kb * 2**10), str(program)]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
      process = subprocess.Popen(command, cwd=work, stdin=subprocess.DEVNULL, stdout=stdout,
                                 stderr=stderr, env={"PATH": os.environ.get("PATH", "")},
                                 start_new_session=True)
      try:
        code = process.wait(timeout=limits.timeout_s)
      except subprocess.TimeoutExpired:
        _kill(process)
        return RunResult(False, "timeout", f"killed after timeout_s={limits.timeout_s:g}")
    detail = err.read_bytes()[-2000:].decode(errors="replace")
  if code == 0:
    return RunResult(True, "passed", detail)
  if code in (-signal.SIGXCPU, -signal.SIGKILL):
    return RunResult(False, "timeout", detail or f"killed by signal {-code}")
  if code == -signal.SIGXFSZ or "File too large" in detail:  # Python ignores SIGXFSZ
    return RunResult(False, "output", f"wrote more than output_kb={limits.output_kb}")
  if "MemoryError" in detail:
    return RunResult(False, "memory", detail)
  if "refused in the code reward's sandbox" in detail:
    return RunResult(False, "refused", detail)
  return RunResult(False, "failed", detail)


def _kill(process: subprocess.Popen) -> None:
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    process.kill()
  process.wait()


def _tests(value: Any, row: int) -> list[str] | None:
  """A row's tests as snippets (None: the row is not scored)."""
  if value is None or (isinstance(value, (str, list, tuple)) and not value):
    return None
  if isinstance(value, str):
    return [value]
  if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
    return list(value)
  raise ConfigError(f"code_reward: row {row}'s tests are {value!r}: allowed Python source (a "
                    "string) or a list of them")


def code_reward(tests_column: str = "tests", *, timeout_s: float = 10.0, cpu_s: int = 10,
                memory_mb: int = 1024, output_kb: int = 1024, weight: float = 1.0,
                name: str = "code") -> RewardFunction:
  """The share of the row's tests (`tests_column`) that the completion's program passes
  (module docstring), each run under `CodeLimits(timeout_s, cpu_s, memory_mb, output_kb)`.

  Raises:
    ConfigError: a limit that is not allowed. A dataset without `tests_column` is refused
      when the task is built (the column is a named parameter of the function).
  """
  limits = CodeLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                      output_kb=output_kb)

  def code(prompts, completions, **columns):
    out = []
    for row, (completion, value) in enumerate(zip(completions, columns[tests_column],
                                                  strict=True)):
      tests = _tests(value, row)
      if tests is None:
        out.append(None)
        continue
      program = extract_program(completion)
      passed = [run_program(f"{program}\n\n{test}\n", limits).passed for test in tests]
      out.append(sum(passed) / len(passed))
    return out

  # The column it reads, as a named parameter: `check_columns` names it when a dataset lacks it.
  code.__signature__ = inspect.Signature(
      [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY)
       for n in (*TEXT_ARGUMENTS, tests_column)])
  return RewardFunction(code, weight=weight, name=name)


__all__ = ["CodeLimits", "RunResult", "code_reward", "extract_program", "network_namespace",
           "run_program"]

