"""Container semantics on both real backends: what real Terminal-Bench / Harbor tasks rely on.

Each case is a small Harbor task written here whose reference solution needs one thing a container
gives (issue 15's failure classes: ENV PATH, USER, WORKDIR /, writes outside /app, normal uids,
a service that must survive into verification, /solution paths, the image's own pytest), typed
through `solution.solution_commands` (by exec and, for the oracle's path, through tmux).
"""

import random
import textwrap
from pathlib import Path

import pytest

from sandbox_service.check_tasks import audit_task, run_solution
from sandbox_service.solution import MAX_LINE_CHARS, solution_commands
from sandbox_service.tasks import load_task

pytestmark = pytest.mark.sandbox


def write_task(root: Path, name: str, *, dockerfile: str, tests: str, solve: str, toml: str = "") -> Path:
    task = root / name
    for sub in ("environment", "tests", "solution"):
        (task / sub).mkdir(parents=True)
    (task / "instruction.md").write_text(f"Task {name}.\n")
    (task / "task.toml").write_text(
        f'[task]\nname = "fidelity/{name}"\n[environment]\nallow_internet = false\n{toml}'
    )
    (task / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    (task / "tests" / "test_outputs.py").write_text(textwrap.dedent(tests))
    (task / "tests" / "test.sh").write_text("#!/bin/bash\ncd /tests && pytest /tests/test_outputs.py\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\nset -e\n" + textwrap.dedent(solve))
    return task


def _sound(backend, task_dir: Path):
    audit = audit_task(load_task(task_dir), backend, run_id="fidelity")
    assert audit.sound, f"{audit.line()}\n--- solution run:\n{audit.solution_run}\n--- verifier:\n" + (
        audit.solution.output_tail if audit.solution else ""
    )
    return audit


def test_env_path_user_and_workdir_root(any_backend, tmp_path):
    task = write_task(
        tmp_path,
        "env-user-workdir",
        dockerfile="""\
            FROM python:3.11-slim
            RUN [ ! -e /opt/tool ] && mkdir -p /opt/tool/bin \\
                && printf '#!/bin/sh\\necho tool-ran\\n' > /opt/tool/bin/tool \\
                && chmod 755 /opt/tool/bin/tool
            ENV PATH=/opt/tool/bin:$PATH
            RUN useradd -m -u 1000 agent
            USER agent
            WORKDIR /
            """,
        tests="""\
            from pathlib import Path
            def test_tool_on_path():
                assert Path("/home/agent/out.txt").read_text() == "tool-ran\\nagent\\n/\\n"
            def test_owned_by_agent():
                assert Path("/home/agent/out.txt").stat().st_uid == 1000
            """,
        solve="(tool; whoami; pwd) > /home/agent/out.txt\n",
    )
    _sound(any_backend, task)


def test_root_writes_users_and_archives_of_other_owners(any_backend, tmp_path):
    task = write_task(
        tmp_path,
        "system-admin",
        dockerfile="FROM debian:bookworm\nWORKDIR /app\n",
        tests="""\
            import os, pwd
            from pathlib import Path
            def test_user_and_ownership():
                assert pwd.getpwnam("svc").pw_uid == 1500
                assert os.stat("/opt/svc/data.txt").st_uid == 1500
            def test_config_outside_app():
                assert Path("/etc/svc.conf").read_text() == "mode=on\\n" and Path("/var/log/svc/ok").exists()
            def test_archive_kept_its_owner():
                assert os.stat("/srv/unpacked/owned").st_uid == 1234
            """,
        solve="""\
            useradd -u 1500 -m svc && mkdir -p /opt/svc /var/log/svc /srv/unpacked
            echo data > /opt/svc/data.txt && chown svc:svc /opt/svc/data.txt
            echo mode=on > /etc/svc.conf && touch /var/log/svc/ok
            mkdir -p /tmp/a && touch /tmp/a/owned && chown 1234:1234 /tmp/a/owned
            tar -C /tmp/a -cf /tmp/a.tar owned && tar -C /srv/unpacked -xpf /tmp/a.tar
            """,
    )
    _sound(any_backend, task)


def test_service_started_by_the_solution_survives_into_verification(any_backend, tmp_path):
    task = write_task(
        tmp_path,
        "keep-serving",
        dockerfile="FROM python:3.11-slim\nWORKDIR /app\n",
        tests="""\
            import urllib.request
            def test_service_answers():
                page = urllib.request.urlopen("http://127.0.0.1:8765/status.txt", timeout=5)
                assert page.read() == b"up\\n"
            """,
        solve="""\
            mkdir -p /srv/www && echo up > /srv/www/status.txt
            cd /srv/www && nohup python3 -m http.server 8765 > /tmp/server.log 2>&1 &
            for i in $(seq 50); do \\
                python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8765/')" \\
                2>/dev/null && break; sleep 0.1; done
            """,
    )
    audit = _sound(any_backend, task)
    assert audit.noop.score() == "0/1"


def test_solution_at_slash_solution_and_image_pytest_without_ctrf(any_backend, tmp_path):
    task = write_task(
        tmp_path,
        "own-pytest",
        dockerfile="FROM python:3.11-slim\nWORKDIR /app\n",
        tests="""\
            from pathlib import Path
            def test_answer():
                assert Path("/app/answer.txt").read_text().strip() == "42"
            """,
        solve="bash /solution/helpers/compute.sh > /app/answer.txt\n",
    )
    helpers = task / "solution" / "helpers"
    helpers.mkdir()
    (helpers / "compute.sh").write_text("echo $((6 * 7))\n")
    # The test script runs `python3 -m pytest` (the image has no pytest of its own: the pinned one runs).
    (task / "tests" / "test.sh").write_text("#!/bin/bash\npython3 -m pytest /tests/test_outputs.py -rA\n")
    _sound(any_backend, task)


def test_solution_commands_typed_into_the_terminal(any_backend, tmp_path):
    """The oracle's path: `solution_commands` typed line by line into the tmux terminal."""
    task_dir = write_task(
        tmp_path,
        "typed",
        dockerfile="FROM python:3.11-slim\nWORKDIR /app\n",
        tests="""\
            from pathlib import Path
            def test_big_file_arrived():
                assert Path("/app/copy.bin").read_bytes() == Path("/solution/blob.bin").read_bytes()
                assert len(Path("/app/copy.bin").read_bytes()) == 3000
            """,
        solve="cp /solution/blob.bin /app/copy.bin\n",
    )
    (task_dir / "solution" / "blob.bin").write_bytes(random.Random(0).randbytes(3000))  # several upload lines
    task = load_task(task_dir)
    lines = solution_commands(task)
    assert len(lines) > 3 and all(len(line) < MAX_LINE_CHARS and line.isascii() for line in lines)
    sandbox = any_backend.create(task, run_id="fidelity")
    try:
        for line in lines:
            sandbox.send_keys(line + "\n", wait_sec=0.3)
        screen = ""
        for _ in range(40):
            screen = sandbox.send_keys("", wait_sec=0.25).text
            if sandbox.exec("test -f /app/copy.bin && echo yes", 10).stdout == "yes\n":
                break
        report = sandbox.verify()
    finally:
        sandbox.close()
    assert report.parsed and (report.passed, report.total) == (1, 1), (screen, report.output_tail)


def test_run_solution_through_exec_reports_its_exit(any_backend, tmp_path):
    task_dir = write_task(
        tmp_path,
        "failing",
        dockerfile="FROM python:3.11-slim\n",
        tests="def test_x():\n    assert False\n",
        solve="echo trying; exit 9\n",
    )
    task = load_task(task_dir)
    sandbox = any_backend.create(task, run_id="fidelity")
    try:
        result = run_solution(task, sandbox)
    finally:
        sandbox.close()
    assert result.exit_code == 9 and "trying" in result.stdout
