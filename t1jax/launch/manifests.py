"""Kubernetes manifests of one t1jax run on TPU pods, rendered from `LaunchParams`.

What a run deploys (`render_manifests`, in apply order):
- the controller namespace, and the sandbox namespace (Pod Security "baseline" enforced: sandboxes
  run task images as they are, root included, but never privileged or on the host's namespaces);
- the RuntimeClass sandboxes run under (gVisor by default; leave it out on GKE, whose GKE Sandbox
  installs a RuntimeClass named `gvisor` itself);
- the sandbox namespace's `default` ServiceAccount and a `t1jax-sandbox` one, both without an API
  token and bound to nothing: code inside a sandbox cannot reach the Kubernetes API;
- a LimitRange (default and maximum CPU / memory / ephemeral storage of a sandbox container), a
  ResourceQuota (how many sandbox pods and how much CPU / memory they may hold at once), and a
  NetworkPolicy denying all ingress to sandboxes (they are reached through exec only; the
  sandbox backend adds its own deny-all policy for tasks without internet);
- the controller's ServiceAccount with a Role in the sandbox namespace that allows exactly what the
  sandbox service's Kubernetes backend calls (pods: create / get / list / watch / delete;
  pods/exec; networkpolicies: create / get);
- the reaper: a CronJob with its own ServiceAccount that deletes the sandboxes of runs whose
  controller pod is gone (`t1jax.launch.reaper`);
- the Pathways JobSet, built by pathwaysutils' own `PathwaysJobSet` (`pathways-head` with the
  resource manager and proxy, `pathways-worker` per TPU slice) with the t1jax controller added as
  the head pod's user workload (`JAX_PLATFORMS=proxy`, the proxy's gRPC address), labelled with the
  run id the reaper matches.

Invariants: rendering is a pure function of the parameters (no cluster, no clock); every name and
label value is a valid DNS-1123 label / label value, checked in `LaunchParams` (defined in the leaf
`t1jax.launch_params`, which the run config reads too); the sandbox labels
are the sandbox service's own (`sandbox_service.backends.kubernetes`), so the reaper and the
backend select the same pods.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from sandbox_service.backends.kubernetes import LABEL_RUN, label_value
from t1jax.launch_params import LaunchParams

CONTROLLER_SERVICE_ACCOUNT = "t1jax-controller"
SANDBOX_SERVICE_ACCOUNT = "t1jax-sandbox"
REAPER_SERVICE_ACCOUNT = "t1jax-sandbox-reaper"
CONTROLLER_CONTAINER = "t1jax-controller"
LABEL_ROLE = "t1jax.role"  # "controller" on the head pod: the reaper's evidence that a run is alive


def _meta(name: str, namespace: str | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = {"app.kubernetes.io/part-of": "t1jax", **(labels or {})}
    return meta


def _namespaces(p: LaunchParams) -> list[dict[str, Any]]:
    baseline = {f"pod-security.kubernetes.io/{mode}": "baseline" for mode in ("enforce", "audit", "warn")}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(p.controller_namespace)},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(p.sandbox_namespace, labels=baseline)},
    ]


def _runtime_class(p: LaunchParams) -> list[dict[str, Any]]:
    if p.runtime_class is None or not p.create_runtime_class:
        return []
    return [
        {
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": _meta(p.runtime_class),
            "handler": p.runtime_handler,
        }
    ]


def _sandbox_namespace_policy(p: LaunchParams) -> list[dict[str, Any]]:
    ns = p.sandbox_namespace
    tokenless = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(name, ns),
            "automountServiceAccountToken": False,
        }
        for name in ("default", SANDBOX_SERVICE_ACCOUNT)
    ]
    limits = {
        "cpu": p.sandbox_cpu,
        "memory": p.sandbox_memory,
        "ephemeral-storage": p.sandbox_ephemeral_storage,
    }
    limit_range = {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": _meta("t1jax-sandbox-limits", ns),
        "spec": {
            "limits": [
                {
                    "type": "Container",
                    "default": dict(limits),
                    "defaultRequest": dict(limits),
                    "max": {"cpu": p.sandbox_max_cpu, "memory": p.sandbox_max_memory},
                }
            ]
        },
    }
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": _meta("t1jax-sandbox-quota", ns),
        "spec": {
            "hard": {
                "pods": str(p.max_sandboxes),
                "limits.cpu": _times(p.sandbox_max_cpu, p.max_sandboxes),
                "limits.memory": _times(p.sandbox_max_memory, p.max_sandboxes),
            }
        },
    }
    deny_ingress = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta("t1jax-sandbox-deny-ingress", ns),
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    }
    return [*tokenless, limit_range, quota, deny_ingress]


def _times(quantity: str, count: int) -> str:
    """`count` times a Kubernetes quantity (integer amounts with an optional binary/decimal unit)."""
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity)
    if match is None:
        raise ValueError(f"quantity {quantity!r} must be an integer with an optional unit (e.g. 8, 16Gi)")
    return f"{int(match.group(1)) * count}{match.group(2)}"


def _rbac(p: LaunchParams) -> list[dict[str, Any]]:
    manager_rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "watch", "delete"]},
        {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create", "get"]},
    ]
    reaper_sandbox_rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "delete"]}]
    reaper_controller_rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]

    def role(name, ns, rules):
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(name, ns),
            "rules": rules,
        }

    def binding(name, ns, account):
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(name, ns),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": p.controller_namespace}],
        }

    accounts = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, p.controller_namespace)}
        for name in (CONTROLLER_SERVICE_ACCOUNT, REAPER_SERVICE_ACCOUNT)
    ]
    return [
        *accounts,
        role("t1jax-sandbox-manager", p.sandbox_namespace, manager_rules),
        binding("t1jax-sandbox-manager", p.sandbox_namespace, CONTROLLER_SERVICE_ACCOUNT),
        role("t1jax-sandbox-reaper", p.sandbox_namespace, reaper_sandbox_rules),
        binding("t1jax-sandbox-reaper", p.sandbox_namespace, REAPER_SERVICE_ACCOUNT),
        role("t1jax-controller-reader", p.controller_namespace, reaper_controller_rules),
        binding("t1jax-controller-reader", p.controller_namespace, REAPER_SERVICE_ACCOUNT),
    ]


def _reaper(p: LaunchParams) -> dict[str, Any]:
    command = [
        "python", "-m", "t1jax.launch.reaper",
        "--sandbox-namespace", p.sandbox_namespace,
        "--controller-namespace", p.controller_namespace,
        "--grace-sec", str(p.reaper_grace_sec),
    ]  # fmt: skip
    container = {
        "name": "reaper",
        "image": p.image,
        "command": command,
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "runAsUser": 65534},
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": _meta("t1jax-sandbox-reaper", p.controller_namespace),
        "spec": {
            "schedule": p.reaper_schedule,
            "concurrencyPolicy": "Forbid",
            "successfulJobsHistoryLimit": 1,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {
                "spec": {
                    "backoffLimit": 0,
                    "activeDeadlineSeconds": 600,
                    "template": {
                        "spec": {
                            "serviceAccountName": REAPER_SERVICE_ACCOUNT,
                            "restartPolicy": "Never",
                            "containers": [container],
                        }
                    },
                }
            },
        },
    }


def _jobset(p: LaunchParams) -> dict[str, Any]:
    from kubernetes import client
    from pathwaysutils.experimental.gke.jobset import PathwaysJobSet

    run_labels = {LABEL_RUN: label_value(p.name), "app.kubernetes.io/part-of": "t1jax"}
    head_pod: dict[str, Any] = {
        "service_account_name": CONTROLLER_SERVICE_ACCOUNT,
        "node_selector": {"cloud.google.com/gke-nodepool": p.head_node_pool},
    }
    mounts = []
    if p.run_config_map is not None:
        head_pod["volumes"] = [
            client.V1Volume(
                name="t1jax-run-config", config_map=client.V1ConfigMapVolumeSource(name=p.run_config_map)
            )
        ]
        mounts = [client.V1VolumeMount(name="t1jax-run-config", mount_path="/etc/t1jax", read_only=True)]
    jobset = PathwaysJobSet(
        name=p.name,
        namespace=p.controller_namespace,
        pathways_dir=p.pathways_dir,
        tpu_type=p.tpu_type,
        topology=p.topology,
        num_slices=p.num_slices,
        pathways_version=p.pathways_version,
        labels=run_labels,
        head_pod_spec_kwargs=head_pod,
    )
    env = {"T1JAX_RUN_ID": p.name, "T1JAX_SANDBOX_NAMESPACE": p.sandbox_namespace, **dict(p.env)}
    jobset.add_user_workload(
        image=p.image,
        command=list(p.command),
        name=CONTROLLER_CONTAINER,
        env=env,
        volume_mounts=mounts,
        resources=client.V1ResourceRequirements(
            requests={"cpu": p.controller_cpu, "memory": p.controller_memory},
            limits={"cpu": p.controller_cpu, "memory": p.controller_memory},
        ),
    )
    manifest = jobset.to_dict()
    head = next(job for job in manifest["spec"]["replicatedJobs"] if job["name"] == "pathways-head")
    pod_meta = head["template"]["spec"]["template"].setdefault("metadata", {})
    pod_meta.setdefault("labels", {}).update({**run_labels, LABEL_ROLE: "controller"})
    return manifest


def render_manifests(params: LaunchParams) -> list[dict[str, Any]]:
    """Every manifest of the run, in an order `kubectl apply` accepts (namespaces first, the
    JobSet last). See the module docstring."""
    return [
        *_namespaces(params),
        *_runtime_class(params),
        *_sandbox_namespace_policy(params),
        *_rbac(params),
        _reaper(params),
        _jobset(params),
    ]


def sandbox_backend_settings(params: LaunchParams) -> dict[str, Any]:
    """The `sandbox_service.backends.kubernetes.KubernetesConfig` fields the controller must use so
    that its sandboxes land where these manifests prepared for them."""
    return {
        "namespace": params.sandbox_namespace,
        "runtime_class_name": params.runtime_class,
        "service_account_name": SANDBOX_SERVICE_ACCOUNT,
    }


def manifest_names(manifests: Sequence[dict[str, Any]]) -> list[str]:
    """`Kind/namespace/name` of each manifest (for listings and error messages)."""
    return [f"{m['kind']}/{m['metadata'].get('namespace', '-')}/{m['metadata']['name']}" for m in manifests]
