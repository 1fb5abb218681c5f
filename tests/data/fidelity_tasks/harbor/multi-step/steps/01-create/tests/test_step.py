import os
from pathlib import Path


def test_a_holds_alpha():
    assert Path("/app/a").read_text().strip() == "alpha"


def test_keeper_runs():
    pid = int(Path("/app/keeper.pid").read_text())
    os.kill(pid, 0)
    assert b"/app/keeper.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
