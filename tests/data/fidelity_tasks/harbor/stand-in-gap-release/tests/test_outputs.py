from pathlib import Path


def test_output():
    assert Path("/app/out.txt").read_text().strip() == "hi"


def test_compiled():
    assert Path("/app/Hello.class").is_file()
