"""One process of the multi-host test (run by tests/test_multihost.py, not by pytest).

  python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES DEVICES_PER_PROCESS PORT OUT_DIR

Joins a `jax.distributed` cluster of local CPU processes (gloo collectives), builds a global
mesh over every process's devices, and runs a sharded forward and two sharded supervised
steps on a batch that each process feeds only its own rows of. Process 0 writes the results.
"""

import sys

import jax

pid, nproc, ndev, port, out_dir = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                   sys.argv[4], sys.argv[5])
jax.config.update("jax_num_cpu_devices", ndev)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_default_matmul_precision", "highest")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc,
                           process_id=pid)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from specjax import sharding  # noqa: E402
from specjax.models import forward  # noqa: E402
from specjax.supervised import init_supervised_state, make_supervised_step  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from support import SUPERVISED_MODEL as CONFIG  # noqa: E402
from support import supervised_global_batch as global_batch  # noqa: E402

assert jax.process_count() == nproc and jax.device_count() == nproc * ndev
mesh = sharding.make_mesh(data=nproc, fsdp=1, tensor=ndev)
params = sharding.init_sharded_params(CONFIG, jax.random.key(0), mesh)
tokens, mask = global_batch()
rows = len(tokens) // nproc
mine = slice(pid * rows, (pid + 1) * rows)
batch_sh = sharding.batch_sharding(mesh, 2)
local = lambda x: jax.make_array_from_process_local_data(batch_sh, x[mine])
g_tokens, g_mask = local(tokens), local(mask)
positions = local(np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.int32))

replicated = sharding.replicated(mesh)
logits = jax.jit(lambda p, t, q: forward(p, CONFIG, t, q).logits,
                 out_shardings=replicated)(params, g_tokens, positions)

optimizer = optax.adam(1e-3, eps=1e-6)
p_sh = sharding.param_shardings(CONFIG, mesh)
state = init_supervised_state(params, optimizer)
state_sh = state.replace(params=p_sh,
                         opt_state=sharding.opt_state_shardings(state.opt_state, params, p_sh),
                         step=replicated)
step = jax.jit(make_supervised_step(CONFIG, optimizer, jit=False),
               in_shardings=(state_sh, batch_sh, batch_sh), out_shardings=(state_sh, replicated),
               donate_argnums=0)
losses = []
for _ in range(2):
  state, metrics = step(state, g_tokens, g_mask)
  losses.append(float(metrics["loss"]))
embed = jax.jit(lambda x: x, out_shardings=replicated)(state.params["embed"])
if pid == 0:
  np.savez(f"{out_dir}/result.npz", logits=np.asarray(logits), losses=np.array(losses),
           embed=np.asarray(embed))
print(f"process {pid}/{nproc}: done", flush=True)
