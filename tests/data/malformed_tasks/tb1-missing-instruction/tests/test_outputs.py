def test_x():
    assert False
