import subprocess
from pathlib import Path


def test_binary_runs():
    assert subprocess.run(["/app/hello"], capture_output=True, text=True).stdout == "hello from go\n"


def test_output_recorded():
    assert Path("/app/out.txt").read_text() == "hello from go\n"
