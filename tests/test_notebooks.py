"""Every notebook under notebooks/ runs top to bottom (code cells in order, one namespace,
matplotlib without a display), so a notebook cannot silently rot as the code changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Notebooks that read a run directory are run on a real run's directory by the controller tests
# (tests/controller/test_train.py), through nbclient.
NEEDS_A_RUN = {"training_curves"}
NOTEBOOKS = sorted(p for p in (REPO / "notebooks").glob("*.ipynb") if p.stem not in NEEDS_A_RUN)


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    monkeypatch.chdir(path.parent)
    namespace: dict = {"__name__": "__notebook__"}
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name}[{index}]", "exec"), namespace)  # noqa: S102
    import matplotlib.pyplot as plt

    plt.close("all")
