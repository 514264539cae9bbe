"""Test setup: 8 fake CPU devices for sharding tests, float32 matmuls at full precision.

XLA_FLAGS must be set before jax is imported anywhere, which is why it lives here.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
