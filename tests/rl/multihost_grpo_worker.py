"""One process of the multi-host GRPO test (run by tests/rl/test_multihost_grpo.py, not by pytest).

  python tests/rl/multihost_grpo_worker.py PROCESS_ID NUM_PROCESSES DEVICES_PER_PROCESS PORT OUT_DIR

Joins a cluster of local CPU processes with `join_cluster` (the path `specjax train` takes),
builds the global `MESH`, places the same initial train state as the single-process
reference on it, and runs the fused GRPO step in sync and in async mode, each process
reading only its own prompts. The final async state (pending rollout included) is
checkpointed by every process together. Process 0 writes the metrics, the parameters and
every leaf of the checkpointed state, gathered. On the way it checks which prompt rows each
process feeds (also under a device order that interleaves the processes) and the broadcast
of host-side values. Topologies: 2 processes x 2 devices, 4 processes x 1 device.
"""

import sys
import time
from pathlib import Path

import jax

pid, nproc, ndev, port, out_dir = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                   sys.argv[4], Path(sys.argv[5]))
jax.config.update("jax_num_cpu_devices", ndev)
jax.config.update("jax_default_matmul_precision", "highest")

from specjax.rl.distributed import join_cluster  # noqa: E402

assert join_cluster(f"localhost:{port}", nproc, pid, env={})

import numpy as np  # noqa: E402

from specjax.checkpoint import Checkpointer  # noqa: E402
from specjax.errors import RewardError  # noqa: E402
from specjax.rl import distributed  # noqa: E402
from specjax.rl.trainer import make_prime_fn, make_split_step  # noqa: E402
from specjax.sharding import MeshConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # support.py
from support import (MESH, PROMPTS, STEPS, TOK, config, flat, initial_state,  # noqa: E402
                     optimizer, reader, reward)

assert jax.process_count() == nproc and jax.device_count() == nproc * ndev == 4
mesh = MESH.make()
# Prompts split over fsdp = 2 (processes in order): each process feeds the half its devices
# hold (2 x 2: its own half; 4 x 1: processes 0, 1 the first half, 2, 3 the second).
half = pid // (nproc // 2)
assert list(distributed.process_rows(mesh, PROMPTS)) == [2 * half, 2 * half + 1]
mine = distributed.process_prompts(reader(), mesh)
batch_shardings = distributed.prompt_batch_shardings(reader().batch_at(0), mesh)
feed = lambda position: distributed.global_batch(mine(position), batch_shardings, PROMPTS)

# A device order that interleaves the processes (as a topology-aware one may; with one
# device per process it is the plain order): process p holds rows p, p + nproc, ... picked
# from the whole batch, and the global batch is still whole.
devices = np.array(jax.devices()).reshape(nproc, ndev).T.reshape(-1)
interleaved = MeshConfig(data=-1).make(list(devices))
assert list(distributed.process_rows(interleaved, PROMPTS)) == list(range(pid, PROMPTS, nproc))
shardings = distributed.prompt_batch_shardings(reader().batch_at(0), interleaved)
picked = distributed.global_batch(distributed.process_prompts(reader(), interleaved)(8),
                                  shardings, PROMPTS)
for got, want in zip(jax.tree.leaves(distributed.local_copy(picked)),
                     jax.tree.leaves(reader().batch_at(8))):
  np.testing.assert_array_equal(got, want)

# Host-side decisions (measured costs) are process 0's everywhere.
assert distributed.broadcast_json({"costs": [0.5, 1e-3]} if pid == 0 else None) == {
    "costs": [0.5, 1e-3]}

results = {}
for mode in ("sync", "async"):
  cfg = config(async_mode=mode == "async")
  state = initial_state(cfg)
  if cfg.async_mode:
    primed = jax.eval_shape(make_prime_fn(cfg, reward, pad_id=TOK.pad_id),
                            state, reader().batch_at(0))
    shardings = distributed.train_state_shardings(primed, mesh, cfg)
    state = distributed.distribute(state, shardings.replace(pending=None))
    prime = distributed.sharded_prime_fn(cfg, reward, shardings, batch_shardings,
                                         pad_id=TOK.pad_id)
    state = prime(state, feed(0))
  else:
    shardings = distributed.train_state_shardings(state, mesh, cfg)
    state = distributed.distribute(state, shardings)
  step = distributed.sharded_train_step(cfg, reward, optimizer(), shardings,
                                        batch_shardings, pad_id=TOK.pad_id)
  offset = PROMPTS if cfg.async_mode else 0
  for i in range(STEPS):
    state, metrics = step(state, feed(offset + PROMPTS * i))
    for key, value in jax.device_get(metrics).items():
      results[f"{mode}/metrics/{i}/{key}"] = np.asarray(value)
  assert state.params["layers"][0]["wq"].sharding == shardings.params["layers"][0]["wq"]
  assert not state.params["embed"].is_fully_addressable  # split across the processes
  for key, value in flat(distributed.local_copy(state.params)).items():
    results[f"{mode}/params/{key}"] = np.asarray(value)

ckpt = Checkpointer(out_dir / "checkpoints")
ckpt.save(STEPS, state, {"step": STEPS})
ckpt.close()
for key, value in flat(distributed.local_copy(state)).items():
  results[f"saved/{key}"] = np.asarray(value)
# The split step with the same reward in Python: each process scores the rows of its own
# prompts (whole groups), the rewards meet as one global array, and the per-row reward values
# are averaged over every process's rows.
scored_rows = []


def host_reward(responses, lengths, batch):
  assert len(responses) == len(lengths) == len(batch.index) * cfg.grpo.group_size
  scored_rows.append(len(responses))
  values = (responses[:, 0] % 2).astype(np.float64)
  return values, {"reward_parity": values}


for mode in ("sync", "async"):
  cfg = config(async_mode=mode == "async")
  state = initial_state(cfg)
  if cfg.async_mode:
    primed = jax.eval_shape(make_prime_fn(cfg, reward, pad_id=TOK.pad_id), state,
                            reader().batch_at(0))
    shardings = distributed.train_state_shardings(primed, mesh, cfg)
    state = distributed.distribute(state, shardings.replace(pending=None))
  else:
    shardings = distributed.train_state_shardings(state, mesh, cfg)
    state = distributed.distribute(state, shardings)
  step = make_split_step(cfg, host_reward, optimizer(), pad_id=TOK.pad_id,
                         state_sharding=shardings)
  if cfg.async_mode:
    state = step.prime(state, feed(0))
  offset = PROMPTS if cfg.async_mode else 0
  for i in range(STEPS):
    state, metrics = step(state, feed(offset + PROMPTS * i))
    for key, value in jax.device_get(metrics).items():
      results[f"split_{mode}/metrics/{i}/{key}"] = np.asarray(value)
  state = step.settled(state)
  for key, value in flat(distributed.local_copy(state.params)).items():
    results[f"split_{mode}/params/{key}"] = np.asarray(value)
# 4 prompts x G=4 over fsdp = 2: each process scores its 2 prompts' 8 rows, never all 16.
assert set(scored_rows) == {8}, scored_rows

# A reward that fails on process 1 only stops every process at once, naming process 1 (none
# waits in a collective for it).
def fails_on_one(responses, lengths, batch):
  if pid == 1:
    raise RewardError("reward function 'parity' returned nan for sample 3")
  return np.zeros(len(lengths), np.float32)


cfg = config(async_mode=False)
shardings = distributed.train_state_shardings(initial_state(cfg), mesh, cfg)
step = make_split_step(cfg, fails_on_one, optimizer(), pad_id=TOK.pad_id,
                       state_sharding=shardings)
begin = time.perf_counter()
try:
  step(distributed.distribute(initial_state(cfg), shardings), feed(0))
  raise AssertionError("a reward that failed on process 1 did not stop the step")
except RewardError as err:
  expected = "returned nan for sample 3" if pid == 1 else "failed on process 1 of"
  assert expected in str(err), err
results["fault_s"] = np.asarray(time.perf_counter() - begin)

if pid == 0:
  np.savez(out_dir / "result.npz", **results)
print(f"process {pid}/{nproc}: done", flush=True)
