from pathlib import Path


def test_written_in_the_root_directory():
    assert Path("/where.txt").read_text().strip() == "root"
