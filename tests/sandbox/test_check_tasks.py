"""Reference-solution audit: the example pool is sound; broken tasks are reported unsound, with why."""

import shutil

import pytest

from sandbox_service.check_tasks import TaskAudit, TrialOutcome, all_sound, check_tasks, format_audit_line

from .conftest import HARBOR_HELLO, MALFORMED, TASKS, TB1_LOGS

pytestmark = pytest.mark.sandbox


def test_example_tasks_are_all_sound(backend):
    lines = []
    audits = check_tasks(TASKS, backend, on_audit=lambda audit: lines.append(audit.line()))
    assert sorted(lines) == sorted(
        [
            "t1jax/build-steps sound solution 5/5 noop 2/5",
            "t1jax/hello-world sound solution 2/2 noop 0/2",
            "sales-report sound solution 7/7 noop 0/7",
            "hello-world sound solution 2/2 noop 0/2",
            "log-parsing sound solution 7/7 noop 0/7",
        ]
    )
    assert [a.source_dir for a in audits] == sorted(a.source_dir for a in audits)  # path order
    assert all_sound(audits)
    assert backend.live_sandboxes("check-tasks") == []


def test_unsound_tasks_are_reported_with_reasons(backend, tmp_path):
    pool = tmp_path / "pool"
    trivially_passing = shutil.copytree(HARBOR_HELLO, pool / "noop-passes")
    (trivially_passing / "tests" / "test_outputs.py").write_text("def test_nothing():\n    assert True\n")
    (trivially_passing / "task.toml").write_text('[task]\nname = "noop-passes"\n')
    wrong_solution = shutil.copytree(TB1_LOGS, pool / "wrong-solution")
    (wrong_solution / "solution.sh").write_text("#!/bin/bash\necho requests=7 > /app/summary.txt\n")
    no_solution = shutil.copytree(HARBOR_HELLO, pool / "no-solution")
    shutil.rmtree(no_solution / "solution")
    (no_solution / "task.toml").write_text('[task]\nname = "no-solution"\n')
    shutil.copytree(MALFORMED / "bad-toml", pool / "bad-toml")
    shutil.copytree(MALFORMED / "unsupported-instruction", pool / "unsupported-instruction")

    audits = {audit.source_dir.name: audit for audit in check_tasks(pool, backend)}
    assert not all_sound(audits.values())
    assert audits["noop-passes"].line() == (
        "noop-passes unsound solution 1/1 noop 1/1 (doing nothing already passes)"
    )
    wrong = audits["wrong-solution"]
    assert not wrong.sound and wrong.solution.score() == "1/7" and wrong.noop.score() == "0/7"
    assert "reference solution does not pass all" in wrong.reason
    assert audits["no-solution"].line() == "no-solution unsound solution - noop - (no reference solution)"
    assert (
        audits["bad-toml"].line().startswith("bad-toml unsound solution - noop - (does not load: task.toml:")
    )
    unsupported = audits["unsupported-instruction"]
    assert not unsupported.sound and "VOLUME is outside the supported subset" in unsupported.reason
    assert backend.live_sandboxes("check-tasks") == []


def test_audit_line_without_per_assertion_reports():
    outcome = TrialOutcome(
        passed=0, total=0, parsed=False, binary_outcome=True, failure_cause="missing_report"
    )
    failing = TrialOutcome(
        passed=0, total=0, parsed=False, binary_outcome=False, failure_cause="missing_report"
    )
    audit = TaskAudit("t", HARBOR_HELLO, True, outcome, failing)
    assert format_audit_line(audit) == "t sound solution pass(missing_report) noop fail(missing_report)"
    assert outcome.passes_all and failing.fails_some and not all_sound([])
