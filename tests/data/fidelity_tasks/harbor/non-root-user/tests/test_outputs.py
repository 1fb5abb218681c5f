import os
from pathlib import Path


def test_done_file_is_the_users():
    path = Path("/home/builder/project/done.txt")
    assert path.read_text().strip() == "built" and path.stat().st_uid == 1000


def test_release_unpacked():
    assert Path("/home/builder/release/VERSION").read_text().strip() == "v1"
