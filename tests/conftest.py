"""Test setup: 8 fake CPU devices for sharding tests, float32 matmuls at full precision, and
one compilation cache on disk for the whole run.

XLA_FLAGS must be set before jax is imported anywhere, which is why it lives here.
"""

import os
import shutil
import tempfile

# Named again in support.py, which imports JAX and so cannot be imported before this.
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Compiling is most of this suite's time on CPU, and LLVM's optimisation passes about a third of
# each compilation (measured: a compile-bound test 64 s -> 41 s); at these tiny shapes the code
# they would speed up runs for milliseconds. The HLO the tests check is the same either way.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"{DEVICE_COUNT_FLAG}=8 {FAST_COMPILE_FLAG}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from specjax.models import ModelConfig  # noqa: E402
from support import (PROGRESSION_VOCAB, built_once, progression_batch,  # noqa: E402
                     train_progression_model)

# Compiling, not running, is most of this suite's time on CPU, and many tests compile the same
# programs (the same decode loop on the same tiny models, the same train step) in different
# modules, processes and subprocesses, after `_drop_compiled_programs` has dropped them from
# memory. One on-disk cache per run (made by the first process, the xdist controller, and
# inherited by its workers and every subprocess through the environment) compiles each once.
_CACHE_VAR = "SPECJAX_TEST_COMPILATION_CACHE"
_cache_owner = pytest.StashKey[str]()


def pytest_configure(config):
  if _CACHE_VAR not in os.environ:  # the run's first process: it owns the cache
    os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="specjax-tests-compiled-")
    config.stash[_cache_owner] = os.environ[_CACHE_VAR]
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_VAR]
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VAR])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_unconfigure(config):
  owned = config.stash.get(_cache_owner, None)
  if owned:
    shutil.rmtree(owned, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Drop every compiled program after each test module: a worker runs half the suite, and
  the executables of earlier modules (never called again) otherwise pile up until XLA's
  compiler runs out of memory (it segfaulted compiling late in a worker on the 24 GiB CI
  machine). Session fixtures keep their arrays; their functions recompile when called."""
  yield
  jax.clear_caches()


@pytest.fixture(scope="session")
def progression_models(tmp_path_factory):
  """A target with 3 MTP modules and 3 Medusa heads, and a 1-layer draft model, both trained
  in a few seconds on arithmetic progressions (so drafts are often, not always, accepted);
  once per run, whichever worker asks first."""
  target = ModelConfig(vocab_size=PROGRESSION_VOCAB, d_model=64, n_layers=2, n_heads=4,
                       n_kv_heads=2, head_dim=16, mlp_dim=128, num_mtp_modules=3,
                       num_medusa_heads=3, max_position=128)
  draft = ModelConfig(vocab_size=PROGRESSION_VOCAB, d_model=32, n_layers=1, n_heads=2,
                      n_kv_heads=1, head_dim=16, mlp_dim=64, max_position=128)
  trained = built_once(tmp_path_factory, "progression_models", lambda: {
      "params": train_progression_model(target, 250, 0),
      "draft_params": train_progression_model(draft, 150, 1)})
  return {"config": target, "draft_config": draft, **trained}


@pytest.fixture(scope="session")
def progression_eagle(progression_models, tmp_path_factory):
  """An EAGLE-3 head for `progression_models`' target, trained with the training-time test
  on the same kind of sequences (a few seconds), over a reduced 28-token draft vocabulary."""
  from specjax.supervised.eagle3 import draft_vocab_from_data, train_eagle3
  from specjax.models import Eagle3Config

  m = progression_models
  config = Eagle3Config.for_target(m["config"], draft_vocab_size=28)

  def train():
    rng = np.random.default_rng(7)
    data = [progression_batch(rng, 16, 32) for _ in range(80)]
    mask = np.ones((16, 32), np.int32)
    d2t = draft_vocab_from_data(np.stack(data), None, PROGRESSION_VOCAB, 28)
    weights, _ = train_eagle3(m["params"], m["config"], config, ((t, mask) for t in data),
                              optimizer=optax.adam(3e-3), d2t=d2t, key=jax.random.key(3))
    return weights

  return {"config": config, "weights": built_once(tmp_path_factory, "progression_eagle", train)}
