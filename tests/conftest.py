"""Test-wide setup: 8 fake CPU devices, requested before anything imports jax.

No suite-wide persistent compilation cache: deserialising a cached XLA:CPU executable crashed a
worker with a segmentation fault (jax 0.10.2, in `compilation_cache.get_executable_and_time`,
while another process wrote the same directory). Tests whose subprocesses recompile the same
programs (the controller's resume runs) give their own runs a private cache directory."""

import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
