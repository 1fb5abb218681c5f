import os
import time
from pathlib import Path


def _pid() -> int:
    return int(Path("/app/worker.pid").read_text().strip())


def test_the_recorded_pid_is_the_running_worker():
    pid = _pid()
    os.kill(pid, 0)  # it exists and we may signal it
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"/app/worker.py" in command
    assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_worker_is_still_beating():
    before = len(Path("/app/heartbeat").read_text().splitlines())
    time.sleep(1.0)
    assert len(Path("/app/heartbeat").read_text().splitlines()) > before
