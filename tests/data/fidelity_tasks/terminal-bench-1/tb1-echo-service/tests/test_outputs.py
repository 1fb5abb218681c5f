import sys
from pathlib import Path

sys.path.insert(0, "/tests")
from echo_client import echo


def test_echo():
    assert echo("ping") == "ping"


def test_pid_recorded():
    assert Path("/app/server.pid").read_text().strip().isdigit()
