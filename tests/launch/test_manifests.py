"""Launch manifests: rendered from parameters, validated offline against the Kubernetes API
schemas (kubernetes-validate), RBAC derived from the sandbox backend's own API calls, the committed
example in `deploy/` kept in sync, and the reaper's choice of what to delete."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import re
from pathlib import Path

import pytest
import yaml

client = pytest.importorskip("kubernetes.client")  # the `k8s` extra (installed by `make setup`)

from sandbox_service.backends import kubernetes as backend_module  # noqa: E402
from sandbox_service.backends.kubernetes import KubernetesBackend, KubernetesConfig  # noqa: E402
from t1jax.launch import (  # noqa: E402
    LaunchParams,
    ManifestError,
    render_manifests,
    sandbox_backend_settings,
    validate_manifests,
)
from t1jax.launch.__main__ import main as launch_main  # noqa: E402
from t1jax.launch.__main__ import rendered_yaml  # noqa: E402
from t1jax.launch.reaper import live_runs, orphaned_sandboxes, reap  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PARAMS = LaunchParams(name="run-1", image="registry.example/t1jax:1", pathways_dir="gs://bucket/pw")


def _by_kind(manifests, kind, name=None):
    found = [m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]
    assert found, (kind, name)
    return found[0]


def test_rendered_manifests_are_valid_kubernetes_objects():
    manifests = render_manifests(PARAMS)
    assert validate_manifests(manifests, "1.33") == "1.33"
    kinds = [m["kind"] for m in manifests]
    assert kinds[:2] == ["Namespace", "Namespace"] and kinds[-1] == "JobSet"
    assert {"RuntimeClass", "ServiceAccount", "Role", "RoleBinding", "LimitRange", "ResourceQuota"} <= set(
        kinds
    )
    assert {"NetworkPolicy", "CronJob"} <= set(kinds)


def test_the_committed_example_is_the_rendering_of_its_parameters():
    params = LaunchParams.from_mapping(yaml.safe_load((DEPLOY / "example-params.yaml").read_text()))
    manifests = render_manifests(params)
    validate_manifests(manifests)
    assert (DEPLOY / "example-manifests.yaml").read_text() == rendered_yaml(manifests), (
        "deploy/example-manifests.yaml is stale: python -m t1jax.launch render deploy/example-params.yaml "
        "--out deploy/example-manifests.yaml"
    )


@pytest.mark.parametrize(
    "kind,edit,message",
    [
        ("LimitRange", lambda m: m["spec"]["limits"][0].update(maximum={"cpu": "1"}), "maximum"),
        ("ResourceQuota", lambda m: m["spec"].update(hard=["pods"]), "hard"),
        ("Role", lambda m: m["rules"][0].update(verbs="create"), "verbs"),
        (
            "CronJob",
            lambda m: m["spec"]["jobTemplate"]["spec"]["template"]["spec"].pop("containers"),
            "containers",
        ),
        ("JobSet", lambda m: m["spec"].update(replicatedJob=[]), "unknown JobSet spec field"),
        ("JobSet", lambda m: m["spec"]["coordinator"].update(replicatedJob="head"), "coordinator 'head'"),
        (
            "JobSet",
            lambda m: m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][
                0
            ].update(imagePullPolicy=1),
            "replicatedJob 'pathways-head'",
        ),
    ],
)
def test_validation_rejects_what_the_api_server_would(kind, edit, message):
    manifests = copy.deepcopy(render_manifests(PARAMS))
    edit(_by_kind(manifests, kind))
    with pytest.raises(ManifestError, match=message):
        validate_manifests(manifests)


_RBAC_VERB = {"create": "create", "list": "list", "delete": "delete", "read": "get", "connect_get": "get"}


def test_the_sandbox_role_allows_every_call_of_the_kubernetes_backend():
    """Every `core_api.*` / `networking_api.*` call in the sandbox service's Kubernetes backend
    (named `<verb>_namespaced_<resource>` by the kubernetes client) is allowed by the Role bound
    to the controller's service account, and nothing else is."""
    source = Path(backend_module.__file__).read_text()
    calls = set(re.findall(r"(?:core_api|networking_api),?\s*\.?\s*(\w+_namespaced_\w+)", source))
    calls |= set(re.findall(r"self\.(?:core_api|networking_api)\.(\w+)", source))
    assert calls, "no API calls found in the backend"
    needed = set()
    for call in calls:
        verb, resource = re.fullmatch(
            r"(connect_get|create|list|delete|read)_namespaced_(\w+)", call
        ).groups()
        resource = {"pod": "pods", "pod_exec": "pods/exec", "network_policy": "networkpolicies"}[resource]
        needed.add((resource, _RBAC_VERB[verb]))
    manifests = render_manifests(PARAMS)
    role = _by_kind(manifests, "Role", "t1jax-sandbox-manager")
    assert role["metadata"]["namespace"] == PARAMS.sandbox_namespace
    allowed = {
        (resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]
    }
    assert needed <= allowed
    # websocket exec also needs "create"; watch serves `kubectl get -w` style waits; nothing more
    assert allowed - needed <= {("pods/exec", "create"), ("pods", "watch"), ("networkpolicies", "get")}
    binding = _by_kind(manifests, "RoleBinding", "t1jax-sandbox-manager")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "t1jax-controller", "namespace": PARAMS.controller_namespace}
    ]
    head = _by_kind(manifests, "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert head["serviceAccountName"] == "t1jax-controller"


def test_sandboxes_get_no_api_token_and_the_backend_settings_match_the_manifests():
    manifests = render_manifests(PARAMS)
    accounts = [
        m
        for m in manifests
        if m["kind"] == "ServiceAccount" and m["metadata"]["namespace"] == PARAMS.sandbox_namespace
    ]
    assert {a["metadata"]["name"] for a in accounts} == {"default", "t1jax-sandbox"}
    assert all(a["automountServiceAccountToken"] is False for a in accounts)
    settings = sandbox_backend_settings(PARAMS)
    config = KubernetesConfig(**settings)  # the backend's own config type accepts them
    assert config.namespace == PARAMS.sandbox_namespace
    assert _by_kind(manifests, "RuntimeClass")["metadata"]["name"] == config.runtime_class_name
    assert config.service_account_name in {a["metadata"]["name"] for a in accounts}
    gke = render_manifests(dataclasses.replace(PARAMS, create_runtime_class=False))
    assert not [m for m in gke if m["kind"] == "RuntimeClass"]


def test_the_controller_runs_in_the_pathways_head_with_the_proxy_backend():
    jobset = _by_kind(render_manifests(PARAMS), "JobSet")
    jobs = {job["name"]: job for job in jobset["spec"]["replicatedJobs"]}
    assert set(jobs) == {"pathways-head", "pathways-worker"} and jobs["pathways-worker"]["replicas"] == 1
    pod = jobs["pathways-head"]["template"]["spec"]["template"]
    assert (
        pod["metadata"]["labels"]["t1jax.run-id"] == "run-1"
        and pod["metadata"]["labels"]["t1jax.role"] == "controller"
    )
    controller = next(c for c in pod["spec"]["containers"] if c["name"] == "t1jax-controller")
    env = {e["name"]: e.get("value") for e in controller["env"]}
    assert env["JAX_PLATFORMS"] == "proxy" and env["JAX_BACKEND_TARGET"].startswith("grpc://")
    assert env["T1JAX_RUN_ID"] == "run-1"
    assert {c["name"] for c in pod["spec"]["initContainers"]} == {"pathways-rm", "pathways-proxy"}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"name": "Run_1"}, "name must be a DNS-1123 label"),
        ({"sandbox_namespace": "t1jax"}, "must differ"),
        ({"pathways_dir": "/tmp/x"}, "gs://"),
        ({"topology": "4by4"}, "topology"),
        ({"max_sandboxes": 0}, "max_sandboxes"),
    ],
)
def test_bad_parameters_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PARAMS, **change)


def test_cli_renders_or_exits_2_with_one_line(tmp_path, capsys):
    good = tmp_path / "params.yaml"
    good.write_text(yaml.safe_dump({"name": "run-2", "image": "i:1", "pathways_dir": "gs://b/p"}))
    out = tmp_path / "manifests.yaml"
    assert launch_main(["render", str(good), "--out", str(out)]) == 0
    assert len(list(yaml.safe_load_all(out.read_text()))) == len(render_manifests(PARAMS))
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump({"name": "run-2", "image": "i:1", "pathways_dir": "gs://b/p", "tpu": "v5e"})
    )
    capsys.readouterr()
    assert launch_main(["render", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown launch parameter(s) ['tpu']" in err[0]


# ---- the reaper ------------------------------------------------------------------------------
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def _pod(name, labels, phase="Running", age_sec=3600, deleting=False):
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name,
            labels=labels,
            creation_timestamp=NOW - dt.timedelta(seconds=age_sec),
            deletion_timestamp=NOW if deleting else None,
        ),
        status=client.V1PodStatus(phase=phase),
    )


def _sandbox(name, run, age_sec=3600):
    labels = {backend_module.LABEL_MANAGED_BY: backend_module.MANAGED_BY, backend_module.LABEL_RUN: run}
    return _pod(name, labels, age_sec=age_sec)


def _controller(run, phase="Running", deleting=False):
    return _pod(f"{run}-head", {"t1jax.role": "controller", "t1jax.run-id": run}, phase, deleting=deleting)


def test_only_runs_with_a_pending_or_running_controller_are_alive():
    pods = [
        _controller("a"),
        _controller("b", "Pending"),
        _controller("c", "Failed"),
        _controller("d", deleting=True),
        _pod("x", {"t1jax.run-id": "e"}),  # not a controller pod
    ]
    assert live_runs(pods) == {"a", "b"}
    sandboxes = [
        _sandbox("s1", "a"),
        _sandbox("s2", "c"),
        _sandbox("s3", "c", age_sec=30),
        _sandbox("s4", "z"),
    ]
    assert [p.metadata.name for p in orphaned_sandboxes(sandboxes, {"a", "b"}, NOW, 600)] == ["s2", "s4"]


class _RecordingCoreApi:
    """The two CoreV1Api calls `reap` makes through the backend (no API server can run here)."""

    def __init__(self, pods_by_namespace):
        self.pods = pods_by_namespace
        self.lists, self.deleted = [], []

    def list_namespaced_pod(self, namespace, label_selector):
        self.lists.append((namespace, label_selector))
        return client.V1PodList(items=self.pods[namespace])

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds, propagation_policy):
        self.deleted.append((namespace, name, grace_period_seconds))


def test_reap_deletes_the_sandboxes_of_dead_runs_through_the_backend():
    api = _RecordingCoreApi(
        {"ctl": [_controller("live")], "boxes": [_sandbox("keep", "live"), _sandbox("gone", "dead")]}
    )
    backend = KubernetesBackend(
        KubernetesConfig(namespace="boxes"), core_api=api, networking_api=None, stream_fn=print
    )
    assert reap(backend, controller_namespace="ctl", grace_sec=600, now=NOW) == ["gone"]
    assert api.deleted == [("boxes", "gone", 0)]
    assert api.lists == [("ctl", "t1jax.role=controller"), ("boxes", backend.run_selector(None))]


def test_the_reaper_cronjob_runs_this_module_with_its_own_account():
    manifests = render_manifests(PARAMS)
    cron = _by_kind(manifests, "CronJob")
    spec = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "t1jax-sandbox-reaper"
    assert spec["containers"][0]["command"][:3] == ["python", "-m", "t1jax.launch.reaper"]
    rules = _by_kind(manifests, "Role", "t1jax-sandbox-reaper")["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "delete"]}]
