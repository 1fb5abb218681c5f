"""Launch of a t1jax run on TPU pods: Kubernetes manifests rendered from a few parameters
(`render_manifests(LaunchParams)`), validated offline against the Kubernetes API schemas
(`validate_manifests`), and the sandbox reaper they deploy (`t1jax.launch.reaper`).

`python -m t1jax.launch render PARAMS.yaml [--out FILE]` renders, validates and writes the
manifests as one multi-document YAML (`deploy/` holds an example). Pure Python: it needs the
`k8s` extra (kubernetes, pathwaysutils, kubernetes-validate), no cluster.
"""

from t1jax.launch.manifests import LaunchParams, render_manifests, sandbox_backend_settings
from t1jax.launch.validate import ManifestError, validate_manifests

__all__ = [
    "LaunchParams",
    "ManifestError",
    "render_manifests",
    "sandbox_backend_settings",
    "validate_manifests",
]
