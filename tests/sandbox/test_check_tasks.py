"""Reference-solution audit: the example pool is sound; broken tasks are reported unsound, with why."""

import shutil
import subprocess
import sys
import uuid

import pytest

from sandbox_service.check_tasks import TaskAudit, TrialOutcome, all_sound, check_tasks, format_audit_line
from sandbox_service.contracts import SkipReason
from sandbox_service.fidelity import (
    build_failure_skip,
    environment_audit,
    unresolved_hosts,
    verifier_network_skip,
)
from sandbox_service.tasks import load_task

from .conftest import HARBOR_HELLO, MALFORMED, TASKS, TB1_LOGS

pytestmark = pytest.mark.sandbox
ON_LOCAL = "on local, stand-in"  # every local task runs on a stand-in root
PY311 = "python-3.11-bookworm for python:3.11-slim"


def test_example_tasks_are_all_sound(backend):
    lines = []
    audits = check_tasks(TASKS, backend, on_audit=lambda audit: lines.append(audit.line()))
    assert sorted(lines) == sorted(
        [
            f"t1jax/build-steps sound solution 5/5 noop 2/5 {ON_LOCAL} debian-bookworm for debian:bookworm",
            f"t1jax/hello-world sound solution 2/2 noop 0/2 {ON_LOCAL} {PY311}",
            f"sales-report sound solution 7/7 noop 0/7 {ON_LOCAL} {PY311}",
            f"hello-world sound solution 2/2 noop 0/2 {ON_LOCAL} debian-trixie-ubuntu-base for "
            "ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624",
            f"log-parsing sound solution 7/7 noop 0/7 {ON_LOCAL} python-3.11-bookworm for "
            "python:3.12-slim-bookworm",
        ]
    )
    by_id = {audit.task_id: audit for audit in audits}
    hello = by_id["t1jax/hello-world"]
    assert hello.backend == "local" and hello.environment.substitutions[0].requested == "python:3.11-slim"
    assert (
        "2 passed" in hello.solution.output_tail and "2 failed" in hello.noop.output_tail
    )  # the verifier's output
    assert [a.source_dir for a in audits] == sorted(a.source_dir for a in audits)  # path order
    assert all_sound(audits)
    assert backend.live_sandboxes("check-tasks") == []


def test_unsound_tasks_are_reported_with_reasons(backend, tmp_path):
    pool = tmp_path / "pool"
    trivially_passing = shutil.copytree(HARBOR_HELLO, pool / "noop-passes")
    (trivially_passing / "tests" / "test_outputs.py").write_text("def test_nothing():\n    assert True\n")
    (trivially_passing / "task.toml").write_text('[task]\nname = "noop-passes"\n')
    wrong_solution = shutil.copytree(TB1_LOGS, pool / "wrong-solution")
    (wrong_solution / "solution.sh").write_text("#!/bin/bash\necho requests=7 > /app/summary.txt\n")
    no_solution = shutil.copytree(HARBOR_HELLO, pool / "no-solution")
    shutil.rmtree(no_solution / "solution")
    (no_solution / "task.toml").write_text('[task]\nname = "no-solution"\n')
    shutil.copytree(MALFORMED / "bad-toml", pool / "bad-toml")
    multi_stage = shutil.copytree(MALFORMED / "unsupported-instruction", pool / "multi-stage")
    (multi_stage / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim AS a\nFROM python:3.11-slim\n"
    )
    compose = shutil.copytree(HARBOR_HELLO, pool / "compose")
    (compose / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    build: .\n  db:\n    image: postgres:16\n"
    )

    audits = {audit.source_dir.name: audit for audit in check_tasks(pool, backend)}
    assert not all_sound(audits.values())
    assert audits["noop-passes"].line() == (
        f"noop-passes unsound solution 1/1 noop 1/1 {ON_LOCAL} {PY311} (doing nothing already passes)"
    )
    wrong = audits["wrong-solution"]
    assert not wrong.sound and wrong.solution.score() == "1/7" and wrong.noop.score() == "0/7"
    assert "reference solution does not pass all" in wrong.reason
    assert audits["no-solution"].line().startswith("no-solution unsound solution - noop - on local")
    assert audits["no-solution"].reason == "no reference solution"
    skipped = {name: audits[name] for name in ("multi-stage", "compose")}
    assert all(audit.skipped and not audit.sound for audit in skipped.values())
    assert skipped["multi-stage"].reason.startswith(
        "unsupported_dockerfile: Dockerfile line 2: multi-stage builds"
    )
    assert skipped["compose"].reason.startswith(
        "multi_container: a multi-container compose environment (2 services"
    )
    assert (
        audits["bad-toml"]
        .line()
        .startswith("bad-toml unsound solution - noop - on local (does not load: task.toml:")
    )
    assert backend.live_sandboxes("check-tasks") == []


def test_audit_line_without_per_assertion_reports():
    outcome = TrialOutcome(
        passed=0, total=0, parsed=False, binary_outcome=True, failure_cause="missing_report"
    )
    failing = TrialOutcome(
        passed=0, total=0, parsed=False, binary_outcome=False, failure_cause="missing_report"
    )
    audit = TaskAudit("t", HARBOR_HELLO, True, outcome, failing)
    assert format_audit_line(audit) == "t sound solution pass(missing_report) noop fail(missing_report)"
    # A no-op whose verifier ran out of time did not pass: it failed (not "unknown").
    timed_out = TrialOutcome(
        passed=0, total=0, parsed=False, binary_outcome=None, failure_cause="verifier_timeout"
    )
    assert timed_out.fails_some and timed_out.score() == "unknown(verifier_timeout)"
    assert outcome.passes_all and failing.fails_some and not all_sound([])


def test_gpu_and_internet_needs_are_skips_with_the_reason(backend, tmp_path):
    gpu = shutil.copytree(HARBOR_HELLO, tmp_path / "gpu")
    (gpu / "task.toml").write_text('[task]\nname = "gpu"\n[environment]\ngpus = 1\n')
    audit = environment_audit(load_task(gpu), backend)
    assert audit.skip_reason == SkipReason.NEEDS_GPU and not audit.runnable
    online = shutil.copytree(HARBOR_HELLO, tmp_path / "online")
    (online / "task.toml").write_text('[task]\nname = "online"\n[environment]\nallow_internet = true\n')
    (online / "solution" / "solve.sh").write_text(
        "#!/bin/bash\ncurl -fsSL https://example.com > /app/hello.txt\n"
    )
    audit = environment_audit(load_task(online), backend)
    assert audit.skip_reason == SkipReason.NEEDS_INTERNET and "'curl'" in audit.detail
    (online / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'Hello, world!' > /app/hello.txt\n")
    assert environment_audit(load_task(online), backend).runnable  # allowed, but it needs none


def test_a_build_that_cannot_resolve_a_host_is_a_skip_naming_it(any_backend, tmp_path):
    # `.invalid` never resolves (RFC 2606), with or without a network: apt's real error names it.
    unreachable = shutil.copytree(HARBOR_HELLO, tmp_path / "pool" / "unreachable")
    (unreachable / "task.toml").write_text('[task]\nname = "unreachable"\n')
    update = (
        "RUN echo 'deb http://deb.t1jax.invalid/debian bookworm main' > /tmp/unreachable.list"
        " && apt-get -o Dir::Etc::SourceList=/tmp/unreachable.list -o Dir::Etc::SourceParts=/nonexistent"
        " -o APT::Update::Error-Mode=any update"
    )
    dockerfile = unreachable / "environment" / "Dockerfile"
    dockerfile.write_text(f"FROM debian:bookworm\n{update}\n")
    [audit] = check_tasks(tmp_path / "pool", any_backend)
    assert audit.skipped and audit.reason.startswith("unreachable_host: ")
    assert "deb.t1jax.invalid" in audit.reason
    assert audit.environment.skip_reason == SkipReason.UNREACHABLE_HOST
    assert "skipped on" in audit.line()
    # The download failed quietly (`curl ... | sh` style: the error only on stderr) and a later step
    # finds nothing installed; again when the quiet step's layer comes from the build cache.
    quiet = f"RUN : {uuid.uuid4().hex}\n{update} >/dev/null || true"  # fresh the first time
    dockerfile.write_text(f"FROM debian:bookworm\n{quiet}\nRUN test -x /usr/local/bin/tool\n")
    for build in ("fresh", "cached"):
        [audit] = check_tasks(tmp_path / "pool", any_backend)
        assert audit.skipped and "deb.t1jax.invalid" in audit.reason, (build, audit.reason)
    step_hosts = getattr(any_backend, "_step_hosts", None)
    if step_hosts is not None:  # podman: a cached layer whose record is gone (built by older code)
        for record in step_hosts.directory.glob("*.json"):
            if "deb.t1jax.invalid" in record.read_text():
                record.unlink()
        [audit] = check_tasks(tmp_path / "pool", any_backend)  # rebuilt once without the cache
        assert audit.skipped and "deb.t1jax.invalid" in audit.reason, ("unrecorded", audit.reason)
    # Any other build failure stays the task's own.
    (unreachable / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nRUN exit 3\n")
    [audit] = check_tasks(tmp_path / "pool", any_backend)
    assert not audit.skipped and audit.reason.startswith("sandbox failed: ")


@pytest.mark.parametrize(
    "argv",
    [
        ["curl", "-sS", "https://{host}/"],
        ["wget", "-O", "/dev/null", "https://{host}/"],
        ["git", "ls-remote", "https://{host}/repo.git"],
        ["node", "-e", "require('https').get('https://{host}/').on('error', e => console.error(e.message))"],
    ],
    ids=lambda argv: argv[0],
)
def test_unresolved_hosts_read_from_each_tools_real_message(argv):
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed here")
    host = f"{argv[0]}.t1jax.invalid"
    done = subprocess.run(
        [part.format(host=host) for part in argv], capture_output=True, text=True, timeout=60
    )
    assert unresolved_hosts(done.stdout + done.stderr) == (host,)
    assert unresolved_hosts("ERROR: No matching distribution found for requests") == ()


@pytest.mark.parametrize(
    "argv,peer",
    [
        ([sys.executable, "-c", "import requests; requests.get('http://192.0.2.1:8081/health', timeout=5)"],
         "192.0.2.1:8081"),
        ([sys.executable, "-c", "import requests; requests.get('http://judge.t1jax.invalid:80/', timeout=5)"],
         "judge.t1jax.invalid:80"),
        (["curl", "-sS", "http://192.0.2.1:8081/health"], "192.0.2.1:8081"),
        ([sys.executable, "-c", "import urllib.request as u; u.urlopen('http://192.0.2.1:8081/', timeout=5)"],
         "Network is unreachable"),  # urllib names no host
    ],
    ids=["requests-unreachable", "requests-unresolved", "curl", "urllib"],
)  # fmt: skip
def test_tests_that_cannot_reach_an_outside_host_are_a_skip_naming_it(argv, peer):
    """The real messages of a test's HTTP client in a network namespace with only loopback (as a
    sandbox without internet has); a refused loopback connection is the task's own failure."""
    done = subprocess.run(["unshare", "-n", *argv], capture_output=True, text=True, timeout=60)
    reason, detail = verifier_network_skip(done.stdout + done.stderr)
    assert reason == SkipReason.NEEDS_INTERNET and peer.split(":")[0] in detail
    local = subprocess.run(["unshare", "-n", "curl", "-sS", "http://127.0.0.1:8081/"], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert "Failed to connect to 127.0.0.1" in local.stderr and verifier_network_skip(local.stderr) is None


def test_a_build_adding_an_ubuntu_ppa_is_a_skip_naming_launchpad():
    # The end of Debian's add-apt-repository output when Launchpad cannot be reached (from a real
    # Terminal-Bench task's build on a Debian stand-in): no host name in it.
    log = (
        "task 'x': building its Dockerfile failed (exit 1): ...\n"
        '  File "/usr/lib/python3/dist-packages/softwareproperties/ppa.py", line 113, in lpteam\n'
        "    self._lpteam = self.lp.people(self.teamname)\n"
        "AttributeError: 'NoneType' object has no attribute 'people'\n"
    )
    reason, detail = build_failure_skip(RuntimeError(log))
    assert reason == SkipReason.UNREACHABLE_HOST and "api.launchpad.net" in detail
    assert build_failure_skip(RuntimeError("building its Dockerfile failed (exit 3)")) is None
