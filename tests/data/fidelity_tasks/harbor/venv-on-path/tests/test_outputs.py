from pathlib import Path


def test_prefix_is_the_venv():
    assert Path("/app/prefix.txt").read_text().strip() == "/opt/venv"
