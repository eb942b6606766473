"""Tests of the jax runtime's pieces, run by `make test-jax` in the jax environment
(torch + jax + torchax, no torch_xla; `make venv-jax`). `make test` leaves this
folder out: torchax cannot live in torch_xla's environment (torch_xla 2.9 bundles
an old copy of it)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 4 virtual CPU devices for whatever starts jax first (a torchax test or xladist).
if "host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  ).strip()
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
