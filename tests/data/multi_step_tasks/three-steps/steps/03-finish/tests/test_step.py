from pathlib import Path


def test_the_first_step_is_still_there():
    assert Path("/app/one.txt").read_text().strip() == "one"


def test_final_is_upper_case():
    assert Path("/app/final.txt").read_text().strip() == "ONE"
