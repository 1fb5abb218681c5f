import os
from pathlib import Path


def test_the_first_step_is_still_there():
    assert Path("/app/a").read_text().strip() == "alpha"


def test_b_extends_a_with_the_seed():
    assert Path("/app/seed.txt").read_text().strip() == "omega"  # the step's setup.sh ran
    assert Path("/app/b").read_text().strip() == "ALPHA-omega"


def test_the_first_steps_process_survived():
    os.kill(int(Path("/app/keeper.pid").read_text()), 0)
