from pathlib import Path


def test_the_steps_setup_ran():
    assert Path("/app/words.txt").read_text().split() == ["red", "green", "blue"]


def test_count_is_three():
    assert Path("/app/count.txt").read_text().strip() == "3"
