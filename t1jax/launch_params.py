"""The parameters of one run's deployment on TPU pods (`LaunchParams`): the run config's `launch:`
section (`t1jax.controller.config`) and the input of `t1jax.launch.render_manifests`.

A leaf (standard library only) so that the configuration tree reads the section without importing
the renderer: `t1jax.launch` sits above `t1jax.controller` (its dry run loads run configs), and
the arrows point down.

Invariant: a `LaunchParams` that exists is renderable: every name is a DNS-1123 label, the two
namespaces differ, and the counts are positive (checked in `__post_init__`); `from_mapping`
refuses unknown keys and `to_mapping` is its inverse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class LaunchParams:
    """The parameters of one run's deployment. `name` is the JobSet's name and the run id the
    controller gives the sandbox service (so sandbox pods carry `t1jax.run-id=<name>`)."""

    name: str
    image: str  # the t1jax controller image (also runs the reaper)
    pathways_dir: str  # gs:// scratch location of the Pathways resource manager
    command: tuple[str, ...] = ("t1jax", "train", "--config", "/etc/t1jax/run.yaml")
    tpu_type: str = "v5p"  # a pathwaysutils machine type: v4, v5e, v5p, v6e, tpu7x, ...
    topology: str = "4x4x4"
    num_slices: int = 1
    pathways_version: str = "latest"
    head_node_pool: str = "cpu-np"  # the CPU node pool of the pathways-head pod
    run_config_map: str | None = None  # a ConfigMap mounted at /etc/t1jax in the controller
    controller_namespace: str = "t1jax"
    sandbox_namespace: str = "t1jax-sandboxes"
    controller_cpu: str = "16"
    controller_memory: str = "64Gi"
    sandbox_cpu: str = "2"  # per sandbox container: default request and limit
    sandbox_memory: str = "4Gi"
    sandbox_ephemeral_storage: str = "10Gi"
    sandbox_max_cpu: str = "8"  # the most one sandbox container may ask for
    sandbox_max_memory: str = "16Gi"
    max_sandboxes: int = 512  # pods in the sandbox namespace at once (the quota)
    runtime_class: str | None = "gvisor"
    runtime_handler: str = "runsc"
    create_runtime_class: bool = True  # False on GKE (GKE Sandbox provides `gvisor`)
    reaper_schedule: str = "*/5 * * * *"
    reaper_grace_sec: int = 600  # sandboxes younger than this are never reaped
    env: tuple[tuple[str, str], ...] = field(default=())  # extra controller environment

    def __post_init__(self) -> None:
        for name in ("name", "controller_namespace", "sandbox_namespace"):
            value = getattr(self, name)
            if not (isinstance(value, str) and len(value) <= 63 and _DNS_LABEL.fullmatch(value)):
                raise ValueError(
                    f"{name} must be a DNS-1123 label (lowercase alphanumerics and '-'), got {value!r}"
                )
        if self.controller_namespace == self.sandbox_namespace:
            raise ValueError("the sandbox namespace must differ from the controller namespace")
        if not self.pathways_dir.startswith("gs://"):
            raise ValueError(f"pathways_dir must be a gs:// location, got {self.pathways_dir!r}")
        if not re.fullmatch(r"\d+(x\d+){1,2}", self.topology):
            raise ValueError(f"topology must look like 2x2 or 4x4x4, got {self.topology!r}")
        for name in ("num_slices", "max_sandboxes", "reaper_grace_sec"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.command or not self.image:
            raise ValueError("image and command must be given")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> LaunchParams:
        """From a parsed YAML/JSON mapping; unknown keys are errors (a typo must not be ignored)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown launch parameter(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        for name in ("command",):
            if name in values:
                values[name] = tuple(str(part) for part in values[name])
        if "env" in values:
            values["env"] = tuple((str(k), str(v)) for k, v in dict(values["env"]).items())
        return cls(**values)

    def to_mapping(self) -> dict[str, Any]:
        """The inverse of `from_mapping` (YAML-ready: lists and a dict for `env`)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["command"] = list(self.command)
        values["env"] = dict(self.env)
        return values
