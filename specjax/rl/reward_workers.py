"""Reward workers: Python reward functions called over a pool, with a timeout per call.

A slow reward (math-verify's symbolic comparison, a program run against its tests, a judge
called over the network) should neither serialise a batch on one core nor hang a run. With
`RewardWorkers(workers=N)` (`--rewards.workers N`), each `RewardFunction` of a `DatasetTask`
is called on chunks of the batch's rows (`rows_per_call`; by default the rows split evenly
over the workers) by N workers at once, and the chunks' values are joined in row order, so the
rewards are those of one call on the whole batch.

Two kinds of worker:
- "thread" (the default): the functions run in threads of the training process. Nothing is
  pickled or started, and a function that waits (a subprocess, a request) or releases the GIL
  (NumPy) runs in parallel. A thread cannot be stopped: on a timeout it is abandoned (it
  keeps its core until the function returns) and a new thread takes its place.
- "process": the functions run in worker processes that import nothing but the function
  (pickled by cloudpickle, so closures and functions of a config file travel too). Pure-Python
  work that holds the GIL (sympy inside math-verify) runs in parallel, and a worker that
  hangs is killed on its timeout, one that crashes (a segfault, an out-of-memory kill) is
  replaced and its chunk run once more; a second death stops the run, naming the function and
  the rows. Costs: a start-up (well under a second) per worker, and pickling each chunk.

`timeout_s` bounds each call (a chunk of `rows_per_call` rows; 1 for a timeout per row), from
the moment the function starts (a process's start-up and imports, up to `STARTUP_S`, do not
count).
`on_timeout` says what a timed-out call's rows get: "stop" (the default: a `RewardError`
naming the function and the rows stops the run, whose last checkpoint stays intact),
"unscored" (None: the row's other functions score it; a row no function scored still stops
the run), or "score" (the value `timeout_score`).

The default (one thread, no timeout) calls each function directly, as without workers.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import math
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal


from specjax.checks import is_real, require_field, require_ints
from specjax.errors import ConfigError, RewardError

KINDS = ("thread", "process")
ON_TIMEOUT = ("stop", "unscored", "score")
_WORKER_SCRIPT = Path(__file__).with_name("_reward_worker.py")
# Seconds a worker process may take to start and unpickle a function (import its modules)
# before its call's timeout starts.
STARTUP_S = 60.0


@dataclasses.dataclass(frozen=True)
class RewardWorkers:
  """How a task's Python reward functions are called (module docstring).

  Attributes:
    workers: calls in flight at once (>= 1).
    kind: "thread" or "process" workers.
    timeout_s: seconds one call may take (None: no limit).
    on_timeout: what the rows of a call that timed out get: "stop", "unscored" or "score".
    timeout_score: the reward of a timed-out row with `on_timeout="score"`.
    rows_per_call: rows of one call (0: the batch's rows split evenly over the workers).
  """

  workers: int = 1
  kind: Literal["thread", "process"] = "thread"
  timeout_s: float | None = None
  on_timeout: Literal["stop", "unscored", "score"] = "stop"
  timeout_score: float = 0.0
  rows_per_call: int = 0

  def __post_init__(self):
    require_ints(self, ("workers",), 1, "rewards.")
    require_ints(self, ("rows_per_call",), 0, "rewards.")
    require_field(self, "kind", self.kind in KINDS, f"allowed: {', '.join(map(repr, KINDS))}",
                  "rewards.")
    require_field(self, "on_timeout", self.on_timeout in ON_TIMEOUT,
                  f"allowed: {', '.join(map(repr, ON_TIMEOUT))}", "rewards.")
    timeout = self.timeout_s
    require_field(self, "timeout_s", timeout is None or (is_real(timeout) and timeout > 0),
                  "must be None (no limit) or a number of seconds > 0", "rewards.")
    require_field(self, "timeout_score", is_real(self.timeout_score),
                  "must be a finite number", "rewards.")

  @property
  def inline(self) -> bool:
    """Whether the functions are called directly, on the caller's thread."""
    return self.workers == 1 and self.kind == "thread" and self.timeout_s is None

  def check_functions(self, functions: Sequence[Any]) -> None:
    """Refuse, with process workers, a function that cannot be pickled (by cloudpickle).

    Raises:
      ConfigError: naming the function and why it cannot travel to a worker process.
    """
    if self.kind != "process":
      return
    for fn in functions:
      try:
        _pickled(fn.fn)
      except Exception as err:  # noqa: BLE001 (whatever pickling raises, named)
        raise ConfigError(f"reward function {fn.name!r} cannot be sent to a worker process "
                          f"(rewards.kind='process'): pickling it raised "
                          f"{type(err).__name__}: {err}; use rewards.kind='thread', or keep "
                          "unpicklable objects (open files, locks, clients) out of its "
                          "closure") from None


def _pickled(fn: Any) -> bytes:
  """`fn` pickled by cloudpickle, by value when its module cannot be imported by name in a
  fresh process (a config file run by path, a notebook's `__main__`)."""
  import cloudpickle
  name = getattr(fn, "__module__", None)
  module = sys.modules.get(name) if name else None
  if module is not None and name != "__main__" and not _importable(name):
    cloudpickle.register_pickle_by_value(module)
  return cloudpickle.dumps(fn)


def _importable(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False


@dataclasses.dataclass
class _Task:
  """One call: rows `first:last` of the batch."""
  id: int
  first: int
  last: int
  arguments: dict[str, Any]
  deaths: int = 0
  started: float = 0.0


class _ThreadWorker:
  """A daemon thread calling functions from its inbox; results go to the shared outbox."""

  def __init__(self, outbox: queue.Queue):
    self._inbox: queue.Queue = queue.Queue()
    self._outbox = outbox
    threading.Thread(target=self._serve, daemon=True, name="specjax-reward").start()

  def _serve(self) -> None:
    while True:
      item = self._inbox.get()
      if item is None:
        return
      task, fn = item
      try:
        outcome = ("ok", fn(**task.arguments))
      except Exception as err:  # noqa: BLE001 (every failure goes back to the pool)
        outcome = ("error", type(err).__name__, str(err), err)
      self._outbox.put((self, task.id, outcome))

  def submit(self, task: _Task, key: int, fn: Any, blob: bytes | None) -> None:
    self._inbox.put((task, fn))

  def stop(self) -> None:
    """Retire the thread after its call (it cannot be interrupted)."""
    self._inbox.put(None)

  def describe(self) -> str:
    return "a reward thread"


class _ProcessWorker:
  """A worker process (`_reward_worker.py`) and a daemon thread that relays its replies. Its
  death is reported once, for the call it was running (or is handed next)."""

  def __init__(self, outbox: queue.Queue):
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    self.process = subprocess.Popen(
        [sys.executable, str(_WORKER_SCRIPT), str(to_child), str(from_child)],
        pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL, start_new_session=True)
    os.close(to_child), os.close(from_child)
    self._send = Connection(from_parent, readable=False)
    self._receive = Connection(to_parent, writable=False)
    self._known: set[int] = set()
    self._outbox = outbox
    self._lock = threading.Lock()
    self._current: int | None = None
    self._dead = False
    self._send.send_bytes(pickle.dumps(("path", list(sys.path))))
    threading.Thread(target=self._relay, daemon=True, name="specjax-reward-relay").start()

  @property
  def alive(self) -> bool:
    return not self._dead and self.process.poll() is None

  def _relay(self) -> None:
    while True:
      try:
        message = pickle.loads(self._receive.recv_bytes())
      except (EOFError, OSError):
        code = self.process.wait()
        with self._lock:
          self._dead = True
          self._outbox.put((self, self._current, ("died", code)))
        return
      except Exception as err:  # noqa: BLE001 (a reply that does not unpickle here)
        message = ("error", self._current, type(err).__name__,
                   f"its values could not be read back from the worker process ({err})", "")
      if message[0] == "started":
        self._outbox.put((self, message[1], ("started", time.monotonic())))
      elif message[0] == "ok":
        self._outbox.put((self, message[1], ("ok", message[2])))
      else:
        _, task, kind, text, trace = message
        self._outbox.put((self, task, ("error", kind, text, trace)))

  def submit(self, task: _Task, key: int, fn: Any, blob: bytes | None) -> None:
    with self._lock:
      self._current = task.id
      if self._dead:  # died idle: its relay reported an earlier call
        self._outbox.put((self, task.id, ("died", self.process.returncode)))
        return
    try:
      if key not in self._known:
        self._send.send_bytes(pickle.dumps(("function", key, blob)))
        self._known.add(key)
      self._send.send_bytes(pickle.dumps(("call", task.id, key, task.arguments)))
    except OSError:
      pass  # the process died: its relay reports it for this call
    except Exception as err:  # noqa: BLE001 (an argument that does not pickle)
      self._outbox.put((self, task.id, ("error", type(err).__name__,
                                        f"its arguments could not be sent to the worker "
                                        f"process ({err})", "")))

  def stop(self) -> None:
    """Kill the process and what it started (a call cannot be interrupted otherwise)."""
    if self.process.poll() is None:
      try:
        os.killpg(self.process.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        self.process.kill()
    self._send.close()

  def describe(self) -> str:
    return f"reward worker process {self.process.pid}"


def _death(code: int | None) -> str:
  if code is not None and code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exited with code {code}"


class RewardPool:
  """The workers of `RewardWorkers`, started at the first call and stopped by `close` (or
  leaving a `with` block). Callers from several threads (an async step's background scoring,
  an evaluation) take turns."""

  def __init__(self, settings: RewardWorkers = RewardWorkers()):
    self.settings = settings
    self._outbox: queue.Queue = queue.Queue()
    self._idle: list[Any] = []
    self._busy: dict[Any, int] = {}  # worker -> the id of the call it runs
    self._ids = iter(range(1, 1 << 62))
    self._keys: dict[int, tuple[Any, int, bytes | None]] = {}  # id(fn) -> (fn, key, blob)
    self.timed_out = 0  # calls that timed out since the pool started
    self._turn = threading.Lock()

  def __enter__(self) -> RewardPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Stop every worker (a busy thread is abandoned, a busy process killed)."""
    for worker in [*self._idle, *self._busy]:
      worker.stop()
    self._idle.clear()
    self._busy.clear()

  def _worker(self) -> Any:
    """An idle worker, or a new one (a process that died idle is replaced)."""
    while self._idle:
      worker = self._idle.pop()
      if getattr(worker, "alive", True):
        return worker
      worker.stop()
    return (_ThreadWorker if self.settings.kind == "thread" else _ProcessWorker)(self._outbox)

  def _function(self, fn: Any) -> tuple[int, bytes | None]:
    known = self._keys.get(id(fn))
    if known is None or known[0] is not fn:
      blob = _pickled(fn) if self.settings.kind == "process" else None
      known = self._keys[id(fn)] = (fn, len(self._keys) + 1, blob)
    return known[1], known[2]

  def map_rows(self, name: str, fn: Any, arguments: Mapping[str, Sequence[Any]], rows: int
               ) -> list[tuple[int, int, Any]]:
    """`fn(**arguments)` called on chunks of `rows` rows (every argument a `[rows]`
    sequence): `(first row, end row, what the call returned)` per chunk, in row order. A timed-out
    chunk's values are None ("unscored") or the timeout score ("score").

    Raises:
      RewardError: `fn` raised (naming its rows and the worker), a worker process died twice
        on the same rows, or a call timed out with `on_timeout="stop"`.
    """
    with self._turn:
      return self._map_rows(name, fn, arguments, rows)

  def _map_rows(self, name: str, fn: Any, arguments: Mapping[str, Sequence[Any]], rows: int
                ) -> list[tuple[int, int, Any]]:
    settings = self.settings
    per_call = settings.rows_per_call or max(1, math.ceil(rows / settings.workers))
    todo = collections.deque(
        _Task(next(self._ids), a, min(a + per_call, rows),
              {k: list(v[a:a + per_call]) for k, v in arguments.items()})
        for a in range(0, rows, per_call))
    order = [(task.id, task.first, task.last) for task in todo]
    key, blob = self._function(fn)
    running: dict[int, tuple[_Task, Any]] = {}
    done: dict[int, Any] = {}
    while todo or running:
      while todo and len(running) < settings.workers:
        task, worker = todo.popleft(), self._worker()
        # A process's timeout runs from its "started" (after its start-up and imports).
        task.started = time.monotonic() + (STARTUP_S if settings.kind == "process" else 0.0)
        self._busy[worker] = task.id
        running[task.id] = task, worker
        worker.submit(task, key, fn, blob)
      wait = None
      if settings.timeout_s is not None:
        first = min(task.started for task, _ in running.values())
        wait = max(0.0, first + settings.timeout_s - time.monotonic())
      try:
        worker, task_id, outcome = self._outbox.get(timeout=wait)
      except queue.Empty:
        self._expire(name, running, done)
        continue
      if outcome[0] == "started":
        if task_id in running and running[task_id][1] is worker:
          running[task_id][0].started = outcome[1]
        continue
      self._release(worker, task_id, outcome)
      if task_id not in running or running[task_id][1] is not worker:
        continue  # a call abandoned on its timeout, or a worker's death already handled
      task, _ = running.pop(task_id)
      if outcome[0] == "ok":
        done[task.id] = outcome[1]
      elif outcome[0] == "died":
        task.deaths += 1
        if task.deaths > 1:
          raise RewardError(f"reward function {name!r}: its worker process {_death(outcome[1])} "
                            f"twice while scoring {_rows(task)}; the run stops (check the "
                            "function's memory use, or use rewards.kind='thread' to see the "
                            "error in this process)")
        todo.appendleft(task)  # once more, on a new worker
      else:
        _, kind, text, cause = outcome
        where = f" in {worker.describe()}" if settings.kind == "process" else ""
        trace = f"\n{cause.rstrip()}" if isinstance(cause, str) and cause else ""
        raise RewardError(f"reward function {name!r} raised {kind}: {text} (on {_rows(task)}"
                          f"{where}){trace}") from (cause if isinstance(cause, BaseException)
                                                    else None)
    return [(first, last, done[task_id]) for task_id, first, last in order]

  def _release(self, worker: Any, task_id: int | None, outcome: tuple) -> None:
    """A worker whose call ended: idle again, or (its process dead) forgotten."""
    if self._busy.get(worker) != task_id:
      return  # abandoned on a timeout, or a stale report
    del self._busy[worker]
    if outcome[0] != "died":
      self._idle.append(worker)

  def _expire(self, name: str, running: dict[int, tuple[_Task, Any]],
              done: dict[int, list[Any]]) -> None:
    """Apply `on_timeout` to every call past its deadline; its worker is stopped."""
    settings, now = self.settings, time.monotonic()
    for task_id, (task, worker) in list(running.items()):
      if now - task.started < settings.timeout_s:
        continue
      del running[task_id]
      self._busy.pop(worker, None)
      worker.stop()
      self.timed_out += 1
      if settings.on_timeout == "stop":
        raise RewardError(f"reward function {name!r} took more than rewards.timeout_s="
                          f"{settings.timeout_s:g} s on {_rows(task)} (rewards.on_timeout="
                          "'stop'; 'unscored' leaves such rows to the other functions, "
                          "'score' gives them rewards.timeout_score)")
      value = None if settings.on_timeout == "unscored" else settings.timeout_score
      done[task_id] = [value] * (task.last - task.first)


def _rows(task: _Task) -> str:
  return (f"row {task.first}" if task.last - task.first == 1
          else f"rows {task.first}-{task.last - 1}")
