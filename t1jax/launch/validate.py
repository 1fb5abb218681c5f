"""Offline validation of rendered manifests against the Kubernetes API schemas.

Core kinds are validated by `kubernetes-validate` (the OpenAPI schemas of each Kubernetes release,
shipped in the package), strictly: an unknown field is an error. JobSet is a CRD
(`jobset.x-k8s.io`), whose schema no PyPI or npm package ships; so each of its replicated jobs'
`template` (a `batch/v1` JobTemplateSpec, where every container, volume and env var lives) is
validated as the `batch/v1` Job it becomes, and the JobSet's own fields are checked against the
few rules this module states (`_check_jobset`), not against the CRD schema.

Invariant: `validate_manifests` returns only when every manifest passed; otherwise it raises
`ManifestError` naming the manifest (Kind/namespace/name) and the first schema violation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFAULT_KUBERNETES_VERSION = "1.33"
JOBSET_API_VERSIONS = ("jobset.x-k8s.io/v1alpha2",)
_JOBSET_SPEC_FIELDS = {
    "replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
    "coordinator", "managedBy", "ttlSecondsAfterFinished",
}  # fmt: skip


class ManifestError(ValueError):
    """A rendered manifest that the Kubernetes API would reject."""


def _where(manifest: dict[str, Any]) -> str:
    meta = manifest.get("metadata", {})
    return f"{manifest.get('kind')}/{meta.get('namespace', '-')}/{meta.get('name')}"


def _validate_core(manifest: dict[str, Any], version: str, where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(manifest, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = "/".join(str(p) for p in error.path) or "(top)"
        raise ManifestError(f"{where}: {path}: {error.message}") from error
    except kubernetes_validate.SchemaNotFoundError as error:
        raise ManifestError(f"{where}: no Kubernetes {version} schema for {manifest.get('apiVersion')} "
                            f"{manifest.get('kind')}") from error  # fmt: skip


def _check_jobset(manifest: dict[str, Any], version: str, where: str) -> None:
    if manifest.get("apiVersion") not in JOBSET_API_VERSIONS:
        raise ManifestError(f"{where}: apiVersion must be one of {JOBSET_API_VERSIONS}")
    spec = manifest.get("spec", {})
    unknown = sorted(set(spec) - _JOBSET_SPEC_FIELDS)
    if unknown:
        raise ManifestError(f"{where}: unknown JobSet spec field(s) {unknown}")
    jobs = spec.get("replicatedJobs") or []
    names = [job.get("name") for job in jobs]
    if not jobs or len(set(names)) != len(names):
        raise ManifestError(f"{where}: replicatedJobs must be non-empty with distinct names, got {names}")
    coordinator = spec.get("coordinator", {}).get("replicatedJob")
    if coordinator is not None and coordinator not in names:
        raise ManifestError(f"{where}: coordinator {coordinator!r} is not a replicated job")
    for job in jobs:
        if not (isinstance(job.get("replicas"), int) and job["replicas"] >= 1):
            raise ManifestError(f"{where}: replicatedJob {job.get('name')!r} needs replicas >= 1")
        template = job.get("template", {})
        as_job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {**template.get("metadata", {}), "name": job["name"]},
            "spec": template.get("spec", {}),
        }
        _validate_core(as_job, version, f"{where} replicatedJob {job['name']!r}")


def validate_manifests(
    manifests: Sequence[dict[str, Any]], kubernetes_version: str = DEFAULT_KUBERNETES_VERSION
):
    """Validate every manifest (see the module docstring); returns the Kubernetes schema version
    used."""
    for manifest in manifests:
        where = _where(manifest)
        if manifest.get("kind") == "JobSet":
            _check_jobset(manifest, kubernetes_version, where)
        else:
            _validate_core(manifest, kubernetes_version, where)
    return kubernetes_version
