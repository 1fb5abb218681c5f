"""Hostile agents: each test shows the attack was really attempted (and would work without the
sandbox, where that can be shown) and that it failed or was contained. The verifier-tampering
cases run on both real backends (local bubblewrap and podman containers)."""

import base64
import dataclasses
import secrets
import shutil
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from sandbox_service.contracts import FailureCause
from sandbox_service.tasks import load_task

from .conftest import (
    HARBOR_HELLO,
    REPO,
    TB1_HELLO,
    assert_sandbox_gone,
    copy_task,
    count_processes,
    sandbox_processes,
)

pytestmark = pytest.mark.sandbox


def _resources(task, **environment):
    return dataclasses.replace(task, environment=dataclasses.replace(task.environment, **environment))


# -- reading and writing outside the sandbox -------------------------------------------------------


def test_agent_cannot_read_host_files(backend, hello_task, tmp_path):
    token = secrets.token_hex(16)
    secret = Path("/root") / f".t1jax-host-secret-{token[:8]}"
    secret.write_text(f"host-secret-{token}\n")
    secret.chmod(0o644)  # readable by anyone on the host: only the sandbox's view can hide it
    try:
        assert (REPO / "pyproject.toml").read_bytes() and secret.read_text().startswith("host-secret")
        sandbox = backend.create(hello_task)
        try:
            for path in (REPO / "pyproject.toml", secret):
                result = sandbox.exec(f"cat {path}", 30)
                assert result.exit_code != 0 and result.stdout == "" and "No such file" in result.stderr
            # The root is a stand-in image, not the host's: nothing of the host's files is anywhere in it.
            search = sandbox.exec(
                f"grep -rsl host-secret-{token} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
                "| wc -l",
                120,
            )
            assert search.stdout == "0\n", search.stdout
            shadow = sandbox.exec("cat /etc/shadow", 30).stdout  # the image's own, readable by its root
            assert shadow.startswith("root:") and shadow != Path("/etc/shadow").read_text()
            # The host's processes are invisible: the sandbox's /proc lists only its own.
            listing = sandbox.exec("ls /proc | grep -E '^[0-9]+$'", 30).stdout.split()
            assert 0 < len(listing) < 10
            commands = sandbox.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '", 30).stdout
            assert "pytest" not in commands and "sleep infinity" in commands
        finally:
            sandbox.close()
    finally:
        secret.unlink()


def test_agent_cannot_read_another_sandbox(backend, hello_task):
    victim, attacker = backend.create(hello_task), backend.create(hello_task)
    try:
        victim.exec("echo victim-secret-4711 > /app/secret.txt", 30)
        victim_file = victim.host_root / "app" / "secret.txt"
        assert victim_file.read_text() == "victim-secret-4711\n"  # where the host keeps it
        attempt = attacker.exec(f"cat {victim_file}; cat /proc/{victim.init_pid}/root/app/secret.txt", 30)
        assert "victim-secret" not in attempt.stdout and attempt.exit_code != 0
        assert "No such file" in attempt.stderr
        search = attacker.exec(
            "grep -rs victim-secret /app /tmp /root /run /logs /var/tmp /dev/shm | wc -l", 30
        )
        assert search.stdout == "0\n"
    finally:
        victim.close()
        attacker.close()


def test_writes_anywhere_stay_in_the_sandbox(backend, hello_task):
    """The root is copy-on-write, as in a container: the agent may change any file, and neither the
    host, the shared environment layers nor another sandbox of the same task sees the change."""
    sandbox, neighbour = backend.create(hello_task), backend.create(hello_task)
    try:
        changes = (
            "touch /usr/bin/t1jax-planted && echo evil >> /etc/passwd && mkdir /t1jax-new-top-level && "
            "rm /usr/bin/env && mkdir -p /usr/local/lib/x /opt/tool /var/log/app && echo done"
        )
        assert sandbox.exec(changes, 30).stdout == "done\n"
        assert sandbox.exec("tail -1 /etc/passwd; ls /usr/bin/env", 30).stdout == "evil\n"
        assert (
            neighbour.exec("tail -1 /etc/passwd | grep -c evil; ls /usr/bin/env", 30).stdout
            == "0\n/usr/bin/env\n"
        )
        base = sandbox.environment.base_root
        assert (base / "usr" / "bin" / "env").exists() and not (
            base / "usr" / "bin" / "t1jax-planted"
        ).exists()
        assert not Path("/usr/bin/t1jax-planted").exists() and not Path("/t1jax-new-top-level").exists()
        assert "evil" not in Path("/etc/passwd").read_text() and Path("/usr/bin/env").exists()
        # Root has Docker's default capabilities, not CAP_SYS_ADMIN: no mounts, as in a container.
        for command in ("mount -t tmpfs none /mnt", "mount -o remount,rw /proc"):
            result = sandbox.exec(command, 30)
            assert result.exit_code != 0 and "permission denied" in result.stderr.lower(), result.stderr
    finally:
        sandbox.close()
        neighbour.close()


# -- network ---------------------------------------------------------------------------------------


@pytest.fixture
def host_server():
    """A TCP server on the host's loopback that answers 'host-secret' (reachable from the host)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            with connection:
                connection.sendall(b"host-secret\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as control:  # the server really works
        assert control.recv(64) == b"host-secret\n"
    yield port
    stop.set()
    thread.join()
    server.close()


_CONNECT = (
    'python3 -c "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 3); '
    'print(s.recv(64).decode().strip())" {host} {port}'
)


def test_agent_cannot_reach_the_network(any_backend, hello_task, host_server):
    sandbox = any_backend.create(hello_task)
    try:
        local = sandbox.exec(_CONNECT.format(host="127.0.0.1", port=host_server), 30)
        assert local.exit_code != 0 and "ConnectionRefused" in local.stderr  # its own loopback only
        outside = sandbox.exec(_CONNECT.format(host="1.1.1.1", port=53), 30)
        assert outside.exit_code != 0 and "Network is unreachable" in outside.stderr
        links = sandbox.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1", 30)
        assert links.stdout.split() == ["lo"]
    finally:
        sandbox.close()


def test_network_is_shared_only_when_task_and_backend_allow_it(make_backend, hello_task, host_server):
    open_backend = make_backend(allow_internet=True)
    allowed = _resources(hello_task, allow_internet=True)
    sandbox = open_backend.create(allowed)  # positive control: the same attack works when allowed
    try:
        assert sandbox.exec(_CONNECT.format(host="127.0.0.1", port=host_server), 30).stdout == "host-secret\n"
    finally:
        sandbox.close()
    sandbox = open_backend.create(hello_task)  # the task itself says allow_internet = false
    try:
        assert sandbox.exec(_CONNECT.format(host="127.0.0.1", port=host_server), 30).exit_code != 0
    finally:
        sandbox.close()


# -- processes -------------------------------------------------------------------------------------


def _host_pids(sandbox, needle: bytes) -> list[int]:
    found = []
    for pid in sandbox_processes(sandbox):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:  # exited meanwhile
            continue
    return found


def _wait_for_pids(sandbox, needle: bytes, count: int = 1) -> list[int]:
    """Host pids of the sandbox's processes whose command line contains `needle`, once `count`
    exist (a command's background children may not have exec'd yet when the command returns)."""
    deadline = time.monotonic() + 10
    while len(pids := _host_pids(sandbox, needle)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def test_agent_cannot_kill_processes_of_another_sandbox(backend, hello_task):
    victim, attacker = backend.create(hello_task), backend.create(hello_task)
    try:
        victim.exec("setsid sleep 4242 > /dev/null 2>&1 &", 30)
        (victim_pid,) = _wait_for_pids(victim, b"sleep\x004242")
        listing = attacker.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '", 30).stdout
        assert "4242" not in listing
        attempt = attacker.exec(f"kill -9 {victim_pid}; kill -9 -1; echo done", 30)
        assert "No such process" in attempt.stderr
        assert Path(f"/proc/{victim_pid}").exists() and _host_pids(victim, b"sleep\x004242") == [victim_pid]
        assert victim.exec(count_processes("sleep?4242?*"), 30).stdout == "1\n"
    finally:
        victim.close()
        attacker.close()


def test_fork_bomb_is_contained(make_backend, hello_task):
    backend = make_backend(pids_max=64)
    bomb, bystander = backend.create(hello_task), backend.create(hello_task)
    try:
        started = time.monotonic()
        result = bomb.exec("bomb() { bomb | bomb & }; bomb", timeout_sec=3)
        stats = bomb.cgroups.stat()
        assert stats["pids_max_events"] > 0  # fork was refused at the limit, many times
        assert stats["pids_current"] <= 64
        assert (
            "retry" in result.stderr
            or "Resource temporarily unavailable" in result.stderr
            or result.timed_out
        )
        assert bystander.exec("echo fine", 30).stdout == "fine\n"  # others and the host keep working
        assert subprocess.run(["true"]).returncode == 0
        bomb.close()
        assert time.monotonic() - started < 30
        assert_sandbox_gone(bomb)
    finally:
        bomb.close()
        bystander.close()


def test_memory_bomb_is_contained(backend, hello_task):
    sandbox = backend.create(_resources(hello_task, memory_mb=96))
    try:
        bomb = sandbox.exec('python3 -c "blocks = []\nwhile True: blocks.append(bytearray(16 << 20))"', 60)
        assert bomb.exit_code == 137  # SIGKILLed by the cgroup's OOM killer
        stats = sandbox.cgroups.stat()
        assert stats["oom_kill"] >= 1
        assert stats["memory_max_usage"] <= 96 << 20
        assert sandbox.exec("echo still-alive", 30).stdout == "still-alive\n"
    finally:
        sandbox.close()


def test_filling_the_disk_hits_the_task_storage_cap(backend, hello_task):
    sandbox = backend.create(_resources(hello_task, storage_mb=16, memory_mb=256))
    try:
        fill = sandbox.exec(
            "dd if=/dev/zero of=/app/fill bs=1M count=64; sync; ls -s --block-size=1M /app/fill", 60
        )
        assert fill.exit_code == 0 and "No space left on device" in fill.stderr
        assert int(fill.stdout.split()[0]) <= 16
        more = sandbox.exec(
            "echo x > /tmp/more; echo y > /etc/more", 30
        )  # one cap for every write in the root
        assert more.exit_code != 0 and "No space left on device" in more.stderr
        assert sandbox.exec("rm /app/fill && echo ok > /tmp/more && cat /tmp/more", 30).stdout == "ok\n"
    finally:
        sandbox.close()


def test_daemons_do_not_survive_close(backend, hello_task):
    sandbox = backend.create(hello_task)
    sandbox.exec(
        "setsid sleep 5151 > /dev/null 2>&1 & (sleep 5252 > /dev/null 2>&1 &) ; "
        "nohup sh -c 'while true; do sleep 1; done' > /dev/null 2>&1 & "
        "python3 -c 'import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(5353)' &",
        30,
    )
    for needle in (b"5151", b"5252", b"5353", b"while true"):
        assert len(_wait_for_pids(sandbox, needle)) >= 1
    survivors = sandbox_processes(sandbox)
    assert len(survivors) >= 5
    sandbox.close()
    assert_sandbox_gone(sandbox)
    assert not any(Path(f"/proc/{pid}").exists() for pid in survivors)


# -- tampering with the verifier (both backends) ---------------------------------------------------


_PASSING_CONFTEST = textwrap.dedent(
    """
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome = "passed"
    """
)
_FAKE_REPORTS = (
    "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
    'printf \'%s\' \'{"results": {"tests": [{"name": "a", "status": "passed"}]}}\' '
    "> /logs/verifier/ctrf.json; "
    "printf '%s' '<testsuites><testsuite><testcase name=\"a\"/></testsuite></testsuites>' "
    "> /logs/verifier/junit.xml"
)


def _noop_score(backend, task) -> tuple[int, int]:
    sandbox = backend.create(task)
    try:
        report = sandbox.verify()
    finally:
        sandbox.close()
    return report.passed, report.total


def _write(sandbox, path: str, content: str, mode: str = "644") -> None:
    encoded = base64.b64encode(content.encode()).decode()
    result = sandbox.exec(
        f"mkdir -p $(dirname {path}) && echo {encoded} | base64 -d > {path} && chmod {mode} {path}", 30
    )
    assert result.exit_code == 0, result.stderr


def test_planted_conftest_and_ini_cannot_raise_the_score(any_backend, hello_task, tmp_path, toolchain_dir):
    # Positive control: the planted conftest does turn the task's failing tests green when loaded.
    (tmp_path / "tests").mkdir()
    shutil.copy(HARBOR_HELLO / "tests" / "test_outputs.py", tmp_path / "tests")
    (tmp_path / "tests" / "conftest.py").write_text(_PASSING_CONFTEST)
    control = subprocess.run(
        [
            "/usr/bin/python3",
            "-P",
            "-s",
            str(toolchain_dir / "run_pytest.py"),
            "-p",
            "no:cacheprovider",
            str(tmp_path / "tests"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert control.returncode == 0 and "2 passed" in control.stdout
    sandbox = any_backend.create(hello_task)
    try:
        for directory in ("/", "/app", "/tmp", "/root", "/logs", "/logs/verifier"):
            _write(sandbox, f"{directory.rstrip('/')}/conftest.py", _PASSING_CONFTEST)
        for ini in ("/pytest.ini", "/app/pytest.ini", "/tox.ini"):
            _write(sandbox, ini, "[pytest]\naddopts = -p no:junitxml -p no:terminal\n")
        sitecustomize = f"import os\nos.system({_FAKE_REPORTS!r})\n"
        _write(
            sandbox,
            "/usr/local/lib/python3.11/dist-packages/zz_evil.pth",
            f"import os; os.system({_FAKE_REPORTS!r})\n",
        )
        _write(sandbox, "/usr/lib/python3/dist-packages/sitecustomize.py", sitecustomize)
        assert sandbox.exec("ls /conftest.py /app/conftest.py /pytest.ini", 30).exit_code == 0
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert (report.passed, report.total) == _noop_score(any_backend, hello_task) == (0, 2)
    assert report.reward_value == 0.0


def test_fake_pytest_and_python_hijacks_cannot_raise_the_score(any_backend, hello_task):
    sandbox = any_backend.create(hello_task)
    fake = f"#!/bin/sh\necho FAKE-PYTEST\n{_FAKE_REPORTS}\nexit 0\n"
    hijack_python = f"import os\nos.system({_FAKE_REPORTS!r})\nos._exit(0)\n"
    try:
        for directory in ("/root/.local/bin", "/app", "/tmp", "/usr/local/bin"):
            _write(sandbox, f"{directory}/pytest", fake, "755")
        _write(
            sandbox,
            "/root/.bashrc",
            'export PATH=/root/.local/bin:/app:$PATH\nexport PYTEST_ADDOPTS="-p no:terminal"\n',
        )
        _write(sandbox, "/root/.profile", ". /root/.bashrc\n")
        _write(sandbox, "/etc/profile.d/evil.sh", ". /root/.bashrc\n")
        _write(sandbox, "/app/pytest.py", hijack_python)
        _write(sandbox, "/app/_pytest/__init__.py", hijack_python)
        for name in ("usercustomize.py", "sitecustomize.py"):
            _write(sandbox, f"/root/.local/lib/python3.11/site-packages/{name}", hijack_python)
        # Positive control: in the agent's own shells the hijack works.
        assert sandbox.exec("bash -lic 'pytest /tests' 2>/dev/null", 30).stdout.startswith("FAKE-PYTEST")
        # Last, the interpreters themselves: python3 and bash replaced by scripts that fake reports.
        for target in ("/usr/bin/python3.11", "/usr/bin/bash"):
            sandbox.exec(
                f"cp /bin/dash /tmp/dash; rm -f {target}; printf '#!/tmp/dash\\n%s\\nexit 0\\n' "
                f"'{_FAKE_REPORTS}' > {target} && chmod 755 {target}",
                30,
            )
        assert sandbox.exec("python3 -c 'print(1)'; cat /logs/verifier/reward.txt", 30).stdout == "1\n"
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert report.parsed and (report.passed, report.total) == (0, 2) and report.reward_value == 0.0


def test_planted_reports_are_ignored(any_backend):
    task = load_task(TB1_HELLO)  # a verifier that writes no reward file of its own
    sandbox = any_backend.create(task)
    try:
        assert sandbox.exec(_FAKE_REPORTS + "; cat /logs/verifier/reward.txt", 30).stdout == "1\n"
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert report.parsed and (report.passed, report.total) == (0, 2) and report.reward_value is None


def test_daemon_running_through_verification_cannot_touch_tests_or_reports(any_backend, hello_task):
    """The agent's processes keep running while the verifier runs (services must), but the tests
    and the report directory exist only in the verifier's own mount namespace."""
    sandbox = any_backend.create(hello_task)
    conftest = _PASSING_CONFTEST.replace('"', "'").replace("\n", "\\n")
    # The loop records its pid, and "alive" means that pid: counting processes by command line
    # also counted the loop's forks in the instant before they exec (cat, mkdir, mv, sleep).
    writer = (
        "setsid sh -c 'echo $$ > /tmp/writer.pid; while true; do "
        "cat /tests/test_outputs.py /run/t1jax-verifier/toolchain/run_pytest.py >> /tmp/saw 2>/dev/null; "
        # written aside then renamed: the check below must never catch the file truncated mid-write
        f'mkdir -p /tests 2>/dev/null; printf "{conftest}" > /tests/.c 2>/dev/null; '
        "mv -f /tests/.c /tests/conftest.py 2>/dev/null; "
        f"{_FAKE_REPORTS.replace(chr(39), chr(34))} 2>/dev/null; sleep 0.01; done' > /dev/null 2>&1 &"
    )
    alive = _once_written("/tmp/writer.pid") + "kill -0 $(cat /tmp/writer.pid) && echo alive"
    try:
        sandbox.exec(writer, 30)
        assert sandbox.exec(alive, 30).stdout == "alive\n"  # at verify time
        planted = _once_written("/tests/conftest.py") + "cat /tests/conftest.py"
        assert "pytest_runtest_makereport" in sandbox.exec(planted, 30).stdout  # the loop has run
        report = sandbox.verify()
        seen = _host_file(sandbox, "/tmp/saw")
        still_running = sandbox.exec_raw(alive, 30, as_root=True) if hasattr(sandbox, "exec_raw") else None
    finally:
        sandbox.close()
    assert report.parsed and (report.passed, report.total) == (0, 2) and report.reward_value == 0.0
    assert not seen, f"the daemon read the tests or the toolchain: {seen[:200]}"
    assert still_running is None or still_running.stdout == "alive\n"


def _once_written(path: str) -> str:
    """Shell that waits up to 5 s for `path` to be non-empty (what follows it then reads it)."""
    return f"for i in $(seq 50); do [ -s {path} ] && break; sleep 0.1; done; "


def _host_file(sandbox, path: str) -> str | None:
    """A file of a live sandbox's root, read from the host (local: the holder's view; container: exec)."""
    host_root = getattr(sandbox, "host_root", None)
    if host_root is not None:
        target = host_root / path.lstrip("/")
        return target.read_text() if target.exists() else None
    result = sandbox.exec_raw(f"cat {path} 2>/dev/null", 30, as_root=True)
    return result.stdout if result.exit_code == 0 else None


def test_changed_tests_are_detected_by_checksum(any_backend, tmp_path):
    task_dir = copy_task(HARBOR_HELLO, tmp_path / "task")
    sandbox = any_backend.create(load_task(task_dir))
    try:
        (task_dir / "tests" / "test_outputs.py").write_text("def test_ok():\n    pass\n")
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert report.failure_cause == FailureCause.TESTS_TAMPERED and not report.parsed
    assert "changed test_outputs.py" in report.detail


def test_report_directory_swapped_for_a_symlink_is_ignored(any_backend):
    task = load_task(TB1_HELLO)
    sandbox = any_backend.create(task)
    try:
        swap = sandbox.exec("rm -rf /logs/verifier && ln -s /app /logs/verifier && " + _FAKE_REPORTS, 30)
        assert swap.exit_code == 0 and sandbox.exec("ls /app", 30).stdout.split() == [
            "ctrf.json",
            "junit.xml",
            "reward.txt",
        ]
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert report.parsed and (report.passed, report.total) == (0, 2) and report.reward_value is None


# -- the verifier sees the agent's processes; they cannot reach it ---------------------------------

_PROC_ATTACKER = (
    "setsid bash -c 'echo $$ > /tmp/attacker.pid; while true; do for p in /proc/[0-9]*; do "
    '[ "${p#/proc/}" = "$$" ] && continue; '
    'tr "\\0" " " < $p/cmdline 2>/dev/null | grep -q run_pytest && echo ${p#/proc/} >> /tmp/seen-verifier; '
    "cat $p/root/tests/test_outputs.py >> /tmp/stolen 2>/dev/null; "
    'tr "\\0" "\\n" < $p/environ 2>/dev/null | grep T1JAX_ >> /tmp/stolen 2>/dev/null; '
    "ls -l $p/fd/ 2>/dev/null | grep /tests/ >> /tmp/stolen; "
    "mkdir -p $p/root/logs/verifier 2>/dev/null && echo 1 > $p/root/logs/verifier/reward.txt 2>/dev/null; "
    "done; sleep 0.02; done' > /dev/null 2>&1 < /dev/null &"
)


def test_agent_daemon_cannot_reach_the_verifier_through_proc(any_backend, tmp_path):
    """The verifier sees the agent's processes (by the agent's pids); a daemon the agent left running
    scans /proc for the verifier's processes during verification and tries what /proc offers a
    process of the same uid (their root: the tests and the report directory; their environment;
    their open files). Local: the verifier's processes are in a pid namespace above the agent's, so
    the daemon never sees them. Container: it sees them, but they hold a capability it lacks, so
    their root, environment and descriptors are closed to it. Either way nothing leaks and the
    planted reward is ignored."""
    task_dir = copy_task(HARBOR_HELLO, tmp_path / "task")
    with open(task_dir / "tests" / "test_outputs.py", "a") as tests:
        tests.write("\n\ndef test_slow_enough_to_be_attacked():\n    import time\n    time.sleep(2)\n")
    sandbox = any_backend.create(load_task(task_dir))
    try:
        sandbox.exec(_PROC_ATTACKER, 30)
        pid = sandbox.exec(_once_written("/tmp/attacker.pid") + "cat /tmp/attacker.pid", 30).stdout.strip()
        # The route works between processes the agent owns: another of its processes' root is open.
        probe = sandbox.exec(f"cat /proc/{pid}/root/etc/hostname; tr '\\0' '\\n' < /proc/{pid}/environ", 30)
        assert probe.stdout.startswith("sandbox") and "PATH=" in probe.stdout
        report = sandbox.verify()
        seen = _host_file(sandbox, "/tmp/seen-verifier") or ""
        stolen = _host_file(sandbox, "/tmp/stolen") or ""
    finally:
        sandbox.close()
    assert report.parsed and report.total == 3 and report.passed == 1 and report.reward_value == 0.0
    assert stolen == "", f"the daemon reached the verifier: {stolen[:300]}"
    if hasattr(sandbox, "host_root"):
        assert seen == "", "the verifier's processes are visible to the agent"
    else:
        assert seen, "the daemon never saw the verifier's processes (the attack was not attempted)"
