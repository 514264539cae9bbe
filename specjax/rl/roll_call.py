"""A roll call of a multi-process run before `jax.distributed` starts.

JAX's own rendezvous cannot say what went wrong: a process that never arrives, two processes
started with one id, or processes told different process counts all end, after the whole
timeout, in a C++ abort that names none of them. So every process first reports to process 0
on the coordinator's port (before JAX's coordinator takes it over): its id and the process
count it was given. Process 0 answers every process with the verdict once all N have
reported, or once the timeout has passed, and each raises a `ConfigError` naming the
duplicate id, the count that differs or the processes that did not arrive. Only then do they
call `jax.distributed.initialize`, which then finds everyone present.

Pure sockets and the standard library: one line each way, `specjax-roll-call 1 <id> <count>`
to process 0 and `ok` or `error <message>` back.
"""

from __future__ import annotations

import dataclasses
import errno
import socket
import time

from specjax.errors import ConfigError

_HELLO = "specjax-roll-call 1"
_LINE_LIMIT = 4096


def _host_port(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def roll_call(address: str, count: int, index: int, timeout_s: float) -> None:
  """Return once all `count` processes of the run have reported to process 0 at `address`
  (`HOST:PORT`, the coordinator's), each with a distinct id and the same count.

  Raises:
    ConfigError: on every process that reported, naming the problem: nobody answers at
      `address` (processes other than 0), ids given twice, a different process count, or
      the processes missing after `timeout_s`.
  """
  if index == 0:
    _host(address, count, timeout_s)
  else:
    _report(address, count, index, timeout_s)


@dataclasses.dataclass
class _Present:
  """A process that reported: its id and count, and the connection to answer it on."""
  connection: socket.socket
  index: int | None
  count: int | None
  peer: str


def _listen(port: int) -> socket.socket:
  if socket.has_dualstack_ipv6():
    return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                reuse_port=False)
  return socket.create_server(("", port))


def _read_line(connection: socket.socket, deadline: float) -> str | None:
  data = b""
  while b"\n" not in data and len(data) < _LINE_LIMIT:
    connection.settimeout(max(deadline - time.monotonic(), 0.01))
    try:
      chunk = connection.recv(_LINE_LIMIT)
    except (TimeoutError, OSError):
      return None
    if not chunk:
      return None
    data += chunk
  return data.split(b"\n", 1)[0].decode(errors="replace")


def _parse(line: str | None) -> tuple[int | None, int | None]:
  """(id, count) of a report; (None, None) for anything that is not one."""
  if not line or not line.startswith(_HELLO + " "):
    return None, None
  try:
    index, count = (int(v) for v in line[len(_HELLO) + 1:].split())
  except ValueError:
    return None, None
  return index, count


def _conflicts(present: list[_Present], count: int) -> list[str]:
  """What no waiting can fix: processes given another count, an id given twice, a connection
  that is not a specjax process."""
  problems = []
  counts = sorted({p.count for p in present if p.count is not None and p.count != count})
  if counts:
    ids = [p.index for p in present if p.count in counts]
    problems.append(f"processes {ids} were started with --num-processes "
                    f"{', '.join(map(str, counts))}, process 0 with {count}: give every process "
                    "the same count")
  ids = [p.index for p in present if p.count == count]
  twice = sorted({i for i in ids if ids.count(i) > 1})
  if twice:
    problems.append(f"process id {', '.join(map(str, twice))} was given to more than one "
                    "process (each needs its own --process-id, 1 .. N - 1 beside process 0)")
  strangers = [p.peer for p in present if p.index is None]
  if strangers:
    problems.append(f"{', '.join(strangers)} connected to the coordinator port but did not "
                    "report as a specjax process")
  return problems


def _missing(present: list[_Present], count: int) -> list[int]:
  return sorted(set(range(1, count)) - {p.index for p in present if p.count == count})


def _host(address: str, count: int, timeout_s: float) -> None:
  _, port = _host_port(address)
  deadline = time.monotonic() + timeout_s
  try:
    server = _listen(port)
  except OSError as err:
    taken = ("; the port is taken: another process of this run may also be --process-id 0 (a "
             "run has one process 0, the others 1 .. N - 1), or another run uses it"
             if err.errno == errno.EADDRINUSE else "")
    raise ConfigError(f"process 0 cannot listen on the coordinator port {port} ({err}){taken}"
                      ": pass a free port in --coordinator-address / JAX_COORDINATOR_ADDRESS"
                      ) from None
  present: list[_Present] = []
  with server:
    while (_missing(present, count) and not _conflicts(present, count)
           and time.monotonic() < deadline):
      server.settimeout(max(deadline - time.monotonic(), 0.01))
      try:
        connection, peer = server.accept()
      except (TimeoutError, OSError):
        continue
      index, given = _parse(_read_line(connection, min(deadline, time.monotonic() + 10)))
      present.append(_Present(connection, index, given, f"{peer[0]}:{peer[1]}"))
    problems = _conflicts(present, count)
    missing = _missing(present, count)
    if missing and not problems:
      problems.append(f"processes {missing} of {count} did not report to {address} within "
                      f"{timeout_s:g}s: start them (with --coordinator-address {address}), or "
                      "raise --cluster-timeout")
    problem = ("the processes of this run cannot start together: " + "; ".join(problems)
               if problems else None)
    for p in present:
      with p.connection:
        try:
          p.connection.sendall((f"error {problem}" if problem else "ok").encode() + b"\n")
          # The process closes first, so the port's TIME_WAIT is its, not the coordinator's.
          _read_line(p.connection, time.monotonic() + 5)
        except OSError:
          pass
  if problem:
    raise ConfigError(problem)


def _report(address: str, count: int, index: int, timeout_s: float) -> None:
  host, port = _host_port(address)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      connection = socket.create_connection((host, port), timeout=2.0)
      break
    except OSError as err:
      if time.monotonic() >= deadline:
        raise ConfigError(
            f"nobody answers at the coordinator address {address} after {timeout_s:g}s "
            f"({err}): start process 0 of the run there, or pass the address process 0 "
            "listens on (--coordinator-address / JAX_COORDINATOR_ADDRESS)") from None
      time.sleep(0.5)
  with connection:
    connection.sendall(f"{_HELLO} {index} {count}\n".encode())
    # Process 0 answers once everyone reported, or when its own timeout ran out.
    answer = _read_line(connection, time.monotonic() + timeout_s + 30)
  if answer == "ok":
    return
  if answer and answer.startswith("error "):
    raise ConfigError(answer[len("error "):])
  raise ConfigError(f"process 0 at {address} did not answer this process's roll call "
                    f"({answer!r}): is it a specjax run of the same version?")
