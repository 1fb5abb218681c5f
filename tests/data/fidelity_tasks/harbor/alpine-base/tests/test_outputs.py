from pathlib import Path


def test_os():
    assert Path("/app/os.txt").read_text().strip() == "alpine"
