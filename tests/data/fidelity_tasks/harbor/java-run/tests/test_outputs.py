from pathlib import Path


def test_output():
    assert Path("/app/out.txt").read_text().strip() == "java 21"
