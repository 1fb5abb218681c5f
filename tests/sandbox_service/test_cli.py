"""`python -m sandbox_service` as a user runs it: a real server process, check-tasks, and reap
after a crash. Each test owns its cache directory, so reaping never touches anything else."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from service_helpers import new_run_id
from task_factory import write_hello_task

from sandbox_service.backends.local import LocalBackend
from sandbox_service.client import SandboxServiceClient

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]


def start_server(cache_dir: Path, toolchain_dir: Path, store: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox_service", "--log-level", "warning", "serve", "--backend", "local",
         "--port", "0", "--rate", "off", "--cache-dir", str(cache_dir), "--toolchain-dir", str(toolchain_dir),
         "--task-store", str(store)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    line = process.stdout.readline()
    if not line.startswith("sandbox service listening on "):
        process.kill()
        raise AssertionError(f"server did not start: {line}{process.stdout.read()}")
    return process, line.split()[-1].removesuffix("/v1")


def test_serve_process_runs_trials_and_reclaims_them_on_sigterm(tmp_path, toolchain_dir):
    cache = tmp_path / "cache"
    process, url = start_server(cache, toolchain_dir, tmp_path / "store")
    run_id = new_run_id()
    try:
        with SandboxServiceClient(url) as client:
            task = write_hello_task(tmp_path)
            with client.create(task, run_id=run_id) as sandbox:
                assert sandbox.exec("echo from-the-service", 30).stdout == "from-the-service\n"
            left_open = [client.create(task, run_id=run_id) for _ in range(2)]
            assert client.health()["stats"]["live"] == 2
        observer = LocalBackend(cache_dir=cache, toolchain_dir=toolchain_dir)
        assert sorted(observer.live_sandboxes(run_id)) == sorted(s.sandbox_id for s in left_open)
        observer.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    finally:
        if process.poll() is None:
            process.kill()
    observer = LocalBackend(cache_dir=cache, toolchain_dir=toolchain_dir)
    try:
        assert observer.live_sandboxes() == []
    finally:
        observer.close()


def test_reap_after_the_server_was_killed(tmp_path, toolchain_dir):
    cache = tmp_path / "cache"
    process, url = start_server(cache, toolchain_dir, tmp_path / "store")
    run_id = new_run_id()
    try:
        task = write_hello_task(tmp_path)
        with SandboxServiceClient(url) as client:
            orphans = sorted(client.create(task, run_id=run_id).sandbox_id for _ in range(2))
    finally:
        process.kill()  # no shutdown hook runs: a crash
        process.wait(timeout=60)
    reap = subprocess.run(
        [sys.executable, "-m", "sandbox_service", "reap", "--backend", "local", "--cache-dir", str(cache),
         "--toolchain-dir", str(toolchain_dir), "--run-id", run_id],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert reap.returncode == 0, reap.stderr
    assert sorted(json.loads(reap.stdout)["reaped"]) == orphans
    observer = LocalBackend(cache_dir=cache, toolchain_dir=toolchain_dir)
    try:
        assert observer.live_sandboxes() == []
    finally:
        observer.close()


def test_check_tasks_command_audits_a_task_pool(tmp_path, toolchain_dir):
    pool = tmp_path / "pool"
    shutil.copytree(REPO / "tests" / "data" / "tasks" / "harbor" / "hello-world", pool / "hello-world")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "sandbox_service", "check-tasks", str(pool), "--backend", "local",
         "--cache-dir", str(tmp_path / "cache"), "--toolchain-dir", str(toolchain_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "t1jax/hello-world sound solution 2/2 noop 0/2" in result.stdout
    assert "1/1 tasks sound" in result.stdout
    assert time.monotonic() - started < 300


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandbox_service", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


@pytest.mark.parametrize(
    "args,message",
    [
        (("check-tasks", "/no/such/pool"), "task directory not found: /no/such/pool"),
        (("check-tasks", "sandbox_service/backends"), "no tasks under sandbox_service/backends"),
        (("check-tasks", "--workers", "0", "x"), "argument --workers: must be at least 1, got 0"),
        (("check-tasks", "--task-timeout", "-5", "."), "--task-timeout must be positive, got -5"),
        (("check-tasks", "--backend", "docker", "."), "argument --backend: invalid choice: 'docker'"),
        (("serve", "--port", "eighty"), "argument --port: invalid int value: 'eighty'"),
        (("stand-ins", "--nope"), "unrecognized arguments: --nope"),
        (("frobnicate",), "argument command: invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = _cli("--debug", "check-tasks", "/no/such/pool")
    assert result.returncode != 0 and "Traceback (most recent call last)" in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_check_tasks_ctrl_c_stops_promptly_and_reaps(tmp_path, toolchain_dir, signum):
    """Ctrl-C (or SIGTERM) while a verifier runs: the command cancels its trials, reaps the run and
    exits 128 + the signal within seconds, and no sandbox of the run is left."""
    pool = tmp_path / "pool"
    task = shutil.copytree(REPO / "tests" / "data" / "tasks" / "harbor" / "hello-world", pool / "slow")
    slow_test = "import time\n\n\ndef test_slow():\n    time.sleep(600)\n"
    (task / "tests" / "test_outputs.py").write_text(slow_test)
    (task / "task.toml").write_text('[task]\nname = "slow"\n[verifier]\ntimeout_sec = 900\n')
    cache = tmp_path / "cache"
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox_service", "check-tasks", str(pool), "--backend", "local",
         "--cache-dir", str(cache), "--toolchain-dir", str(toolchain_dir), "--run-id", "ctrl-c"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # faulthandler: a SIGABRT makes it print every thread's stack (below, if it hangs)
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"},
    )  # fmt: skip
    observer = LocalBackend(cache_dir=cache, toolchain_dir=toolchain_dir)
    try:
        deadline = time.monotonic() + 180
        while not observer.live_sandboxes("ctrl-c") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert observer.live_sandboxes("ctrl-c"), "the audit never started a sandbox"
        time.sleep(3)  # into the verifier's sleep
        process.send_signal(signum)
        started = time.monotonic()
        try:
            _, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Seen in full `make test` runs (2026-12-03): a verifier that started as its sandbox
            # closed outlived the close (fixed in local.py; tests/sandbox/test_local_backend.py
            # ::test_close_ends_a_verifier_outside_the_cgroups). Name where it waits if it recurs.
            process.send_signal(signal.SIGABRT)
            _, stderr = process.communicate(timeout=30)
            observer.reap("ctrl-c")
            pytest.fail(f"check-tasks still running 60 s after signal {signum}; threads:\n{stderr[-8000:]}")
        assert process.returncode == 128 + signum and time.monotonic() - started < 30, stderr
        assert "interrupted" in stderr and "Traceback" not in stderr
        assert observer.live_sandboxes("ctrl-c") == []
    finally:
        if process.poll() is None:
            process.kill()
        observer.close()


