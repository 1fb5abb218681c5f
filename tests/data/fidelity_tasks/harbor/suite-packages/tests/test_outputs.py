import subprocess
from pathlib import Path


def test_venv_interpreter_runs():
    out = subprocess.run(["/opt/env/bin/python", "-c", "print('ok')"], capture_output=True, text=True)
    assert out.stdout.strip() == "ok"


def test_version_file_names_the_venv_python():
    assert Path("/app/version.txt").read_text().strip() == "3.11"
