from pathlib import Path


def test_sum():
    assert Path("/app/sum.txt").read_text().strip() == "5050"


def test_the_pinned_numpy_is_installed():
    import numpy

    assert numpy.__version__ == "1.26.4"
