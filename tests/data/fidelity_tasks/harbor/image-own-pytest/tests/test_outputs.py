import sys

sys.path.insert(0, "/app")


def test_add():
    from calc import add

    assert add(2, 3) == 5


def test_add_negative():
    from calc import add

    assert add(-2, -3) == -5
