import sys
from pathlib import Path


def test_python_is_313():
    assert sys.version_info[:2] == (3, 13)


def test_result():
    assert Path("/app/result.txt").read_text().strip() == "Point(x=1, y=5)"
