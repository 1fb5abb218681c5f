from pathlib import Path


def test_python_version_recorded():
    assert Path("/app/greeting.txt").read_text().startswith("Python 3.11")
