from pathlib import Path


def test_lines():
    expected = len(Path("/etc/passwd").read_text().splitlines())
    assert Path("/app/lines.txt").read_text().strip() == str(expected)
