import os
import signal
import subprocess
import time
from pathlib import Path


def _daemon_pid() -> int:
    found = subprocess.run(["pgrep", "-f", "/app/reloader.sh"], capture_output=True, text=True)
    assert found.returncode == 0, "no process runs /app/reloader.sh"
    return int(found.stdout.split()[0])


def test_the_daemon_is_listed_by_ps():
    pid = _daemon_pid()
    listed = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True)
    assert "/app/reloader.sh" in listed.stdout
    assert Path("/app/state").read_text().strip() == "started"


def test_sighup_reloads_and_the_daemon_survives():
    pid = _daemon_pid()
    os.kill(pid, signal.SIGHUP)
    for _ in range(50):
        if Path("/app/state").read_text().strip() == "reloaded":
            break
        time.sleep(0.1)
    assert Path("/app/state").read_text().strip() == "reloaded"
    os.kill(pid, 0)
    assert _daemon_pid() == pid
