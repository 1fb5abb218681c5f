from pathlib import Path


def test_count():
    assert Path("/app/logs.txt").read_text().strip() == "2"
