from pathlib import Path


def test_stamp():
    assert Path("/app/stamp.txt").read_text().strip() == "stamped"
