from pathlib import Path


def test_one_holds_one():
    assert Path("/app/one.txt").read_text().strip() == "one"
