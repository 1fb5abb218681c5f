"""The sandbox reaper: delete the sandboxes of runs whose controller is gone.

Runs as the CronJob `render_manifests` emits (`python -m t1jax.launch.reaper`). A run is alive
while a pod labelled `t1jax.role=controller` and `t1jax.run-id=<run>` exists in the controller
namespace and is Pending or Running (the JobSet head pod; JobSet recreates it on failure, so a
restarting run keeps its sandboxes as long as the new pod exists). Every other run's sandbox pods
(selected by the sandbox service's own labels) are deleted with grace period 0, except pods younger
than `grace_sec` (a controller may create sandboxes before its own pod is visible to a list).

This complements the in-process defences of the sandbox service (its admission reaper, each pod's
`activeDeadlineSeconds`): it acts when the whole controller process died.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from sandbox_service.backends.kubernetes import LABEL_RUN, KubernetesBackend, KubernetesConfig
from sandbox_service.cli_contract import OneLineArgumentParser, run_command
from t1jax.launch.manifests import LABEL_ROLE

LIVE_PHASES = frozenset({"Pending", "Running"})


def live_runs(controller_pods: Iterable[Any]) -> set[str]:
    """Run-id label values of controller pods that are Pending or Running (and not being deleted)."""
    alive = set()
    for pod in controller_pods:
        labels = pod.metadata.labels or {}
        if labels.get(LABEL_ROLE) != "controller" or LABEL_RUN not in labels:
            continue
        if pod.metadata.deletion_timestamp is None and (pod.status and pod.status.phase) in LIVE_PHASES:
            alive.add(labels[LABEL_RUN])
    return alive


def orphaned_sandboxes(
    sandbox_pods: Iterable[Any], alive: set[str], now: dt.datetime, grace_sec: float
) -> list:
    """The sandbox pods to delete: their run is not alive and they are older than `grace_sec`."""
    doomed = []
    for pod in sandbox_pods:
        run = (pod.metadata.labels or {}).get(LABEL_RUN)
        created = pod.metadata.creation_timestamp
        if run in alive or created is None or (now - created).total_seconds() < grace_sec:
            continue
        doomed.append(pod)
    return doomed


def reap(backend: KubernetesBackend, *, controller_namespace: str, grace_sec: float, now=None) -> list[str]:
    """One pass: the sandbox service's Kubernetes backend (its labels, its delete with grace 0)
    over the sandbox namespace; returns the names of the deleted pods."""
    now = now or dt.datetime.now(dt.UTC)
    api = backend.core_api
    controllers = api.list_namespaced_pod(
        namespace=controller_namespace, label_selector=f"{LABEL_ROLE}=controller"
    )
    sandboxes = api.list_namespaced_pod(
        namespace=backend.config.namespace, label_selector=backend.run_selector(None)
    )
    doomed = orphaned_sandboxes(sandboxes.items, live_runs(controllers.items), now, grace_sec)
    return [pod.metadata.name for pod in doomed if backend.delete_pod(pod.metadata.name)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m t1jax.launch.reaper", description=__doc__.splitlines()[0])
    parser.add_argument("--sandbox-namespace", required=True)
    parser.add_argument("--controller-namespace", required=True)
    parser.add_argument("--grace-sec", type=float, default=600.0)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    return run_command("python -m t1jax.launch.reaper", lambda: _reap_dead_runs(args), debug=args.debug)


def _reap_dead_runs(args) -> int:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    backend = KubernetesBackend(
        KubernetesConfig(namespace=args.sandbox_namespace, manage_network_policy=False),
        core_api=client.CoreV1Api(),
        networking_api=None,
    )
    deleted = reap(backend, controller_namespace=args.controller_namespace, grace_sec=args.grace_sec)
    print(f"reaped {len(deleted)} sandbox pod(s) of dead runs: {' '.join(deleted) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
