"""The roll call before `jax.distributed`: a duplicate id, a different process count, a
missing process, a stranger on the port and an empty coordinator address each fail on every
process that reported, within seconds, naming the problem (JAX's rendezvous aborted after its
whole timeout naming none). Negative control: a complete, consistent cluster passes."""

import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from support import ROOT, child_env

from specjax.errors import ConfigError
from specjax.rl.roll_call import roll_call


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _call(processes: list[tuple[int, int]], timeout_s: float = 20.0) -> dict[int, object]:
  """Run `roll_call` for each (id, count) on its own thread, process 0's first; returns each
  position's outcome (None: returned; else the exception) and how long the slowest took."""
  address = f"localhost:{_free_port()}"
  outcomes: dict[int, object] = {}

  def one(position, index, count):
    try:
      roll_call(address, count, index, timeout_s)
      outcomes[position] = None
    except Exception as err:  # noqa: BLE001 - the outcome is what the test checks
      outcomes[position] = err

  threads = [threading.Thread(target=one, args=(k, i, n)) for k, (i, n) in enumerate(processes)]
  threads[0].start()
  time.sleep(0.2)  # process 0 listens first; the others would retry anyway
  for t in threads[1:]:
    t.start()
  for t in threads:
    t.join(timeout_s + 40)
  return outcomes


def test_a_complete_cluster_passes_the_roll_call():
  assert _call([(0, 3), (1, 3), (2, 3)]) == {0: None, 1: None, 2: None}


def test_an_id_given_twice_fails_on_every_process_at_once_naming_it():
  start = time.monotonic()
  outcomes = _call([(0, 3), (1, 3), (1, 3)])
  assert time.monotonic() - start < 10  # not the 20 s timeout
  for err in outcomes.values():
    assert isinstance(err, ConfigError), outcomes
    assert "process id 1 was given to more than one process" in str(err)


def test_a_different_process_count_fails_naming_both_counts():
  outcomes = _call([(0, 3), (1, 2)])
  for err in outcomes.values():
    assert isinstance(err, ConfigError), outcomes
    assert "processes [1] were started with --num-processes 2, process 0 with 3" in str(err)


def test_a_process_that_never_arrives_is_named_after_the_timeout():
  outcomes = _call([(0, 3), (1, 3)], timeout_s=1.5)
  for err in outcomes.values():
    assert isinstance(err, ConfigError), outcomes
    assert "processes [2] of 3 did not report to localhost:" in str(err)
    assert "within 1.5s" in str(err) and "--cluster-timeout" in str(err)


def test_a_stranger_on_the_coordinator_port_is_named():
  port = _free_port()
  outcome = {}

  def host():
    try:
      roll_call(f"localhost:{port}", 2, 0, 10)
    except ConfigError as err:
      outcome["err"] = err

  thread = threading.Thread(target=host)
  thread.start()
  time.sleep(0.3)
  with socket.create_connection(("localhost", port)) as stranger:
    stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
    answer = stranger.recv(4096).decode()
  thread.join(20)
  assert answer.startswith("error ") and "did not report as a specjax process" in answer
  assert "did not report as a specjax process" in str(outcome["err"])


def test_a_second_process_0_fails_at_once_saying_the_port_is_taken():
  port = _free_port()
  with socket.create_server(("", port)):  # process 0 of this run, listening
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"cannot listen on the coordinator port {port} "
                                          r"\(.*\); the port is taken: another process of this "
                                          r"run may also be --process-id 0"):
      roll_call(f"localhost:{port}", 2, 0, 20)
    assert time.monotonic() - start < 5


def test_nobody_at_the_coordinator_fails_naming_the_address():
  port = _free_port()
  with pytest.raises(ConfigError, match=rf"nobody answers at the coordinator address "
                                        rf"localhost:{port} after 1s"):
    roll_call(f"localhost:{port}", 2, 1, 1)


_JOIN = textwrap.dedent("""
    import sys
    from specjax.rl.distributed import join_cluster
    port, pid = sys.argv[1], int(sys.argv[2])
    join_cluster(f"localhost:{port}", 3, pid, env={}, detect=False, timeout_s=60,
                 log=lambda _: None)
    """)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_specjax_processes_with_one_id_exit_within_seconds_naming_it():
  """Real processes through `join_cluster`: two started with --process-id 1 all end with the
  message in seconds, where JAX's rendezvous ran out its timeout and aborted."""
  port = str(_free_port())
  start = time.monotonic()
  procs = [subprocess.Popen([sys.executable, "-c", _JOIN, port, pid], env=child_env(),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for pid in ("0", "1", "1")]
  outputs = [p.communicate(timeout=120)[0] for p in procs]
  assert time.monotonic() - start < 50  # the roll call waits up to 60 s for a missing one
  for proc, out in zip(procs, outputs):
    assert proc.returncode != 0, out
    assert "ConfigError: the processes of this run cannot start together: process id 1 was " \
           "given to more than one process" in out, out[-2000:]
