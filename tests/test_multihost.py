"""Multi-host: several local CPU processes joined by `jax.distributed` give the single-process
results (2 processes x 2 devices and 4 processes x 1 device)."""

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support import SUPERVISED_MODEL as CONFIG
from support import child_env
from support import supervised_global_batch as global_batch

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _single_process_reference():
  import jax
  import optax

  from specjax.models import forward, init_params
  from specjax.supervised import init_supervised_state, make_supervised_step

  params = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))
  tokens, mask = global_batch()
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  logits = forward(params, CONFIG, tokens, positions).logits
  optimizer = optax.adam(1e-3, eps=1e-6)
  state = init_supervised_state(params, optimizer)
  step = make_supervised_step(CONFIG, optimizer)
  losses = []
  for _ in range(2):
    state, metrics = step(state, tokens, mask)
    losses.append(float(metrics["loss"]))
  return np.asarray(logits), np.array(losses), np.asarray(state.params["embed"])


@pytest.mark.slow
@pytest.mark.parametrize("processes,devices", [(2, 2), (4, 1)])
def test_local_processes_reproduce_the_single_process_results(tmp_path, processes, devices):
  port = str(_free_port())
  worker = Path(__file__).with_name("multihost_worker.py")
  env = child_env()
  procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(processes), str(devices),
                             port, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for i in range(processes)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  result = np.load(tmp_path / "result.npz")
  logits, losses, embed = _single_process_reference()
  np.testing.assert_allclose(result["logits"], logits, atol=1e-5)
  np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
  np.testing.assert_allclose(result["embed"], embed, atol=1e-5)
