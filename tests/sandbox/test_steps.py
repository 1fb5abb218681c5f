"""Multi-step Harbor tasks: loading both test layouts (shared tests/ with each step's tests/ over it;
each step's own tests/test.sh), Harbor's reward strategies and min_reward gating (checked against
Harbor's own code where its package is installed), and trials on both real backends, directly, in
process through admission control and over HTTP: each step verified in turn, the environment
carried over, and a hostile agent between steps caught."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.check_tasks import check_tasks, run_solution
from sandbox_service.client import SandboxServiceClient
from sandbox_service.contracts import FailureCause, SandboxError, VerifierReport
from sandbox_service.server import ServiceThread, TaskStore, create_app
from sandbox_service.steps import (
    combined_report,
    setup_commands,
    step_count,
    step_view,
    stops_after,
    trial_reward,
)
from sandbox_service.tasks import TaskLoadError, load_task

from .conftest import REPO, copy_task

CORPUS = REPO / "tests" / "data" / "fidelity_tasks" / "harbor"
LAYERED = CORPUS / "multi-step"  # shared tests/test.sh, each step's tests/ over it
OWN_TESTS = CORPUS / "multi-step-own-tests"  # each step's own tests/test.sh
HARBOR_PYTHON = REPO / ".venv-harbor" / "bin" / "python"  # Harbor's package (Python >= 3.12), if set up


def _report(reward: float | None, *, outcome: bool | None = None, passed: int = 1, total: int = 1):
    from sandbox_service.contracts import AssertionResult

    assertions = tuple(AssertionResult(f"t{i}", i < passed) for i in range(total))
    return VerifierReport(assertions, True, FailureCause.NONE, outcome, reward)


# -- loading -----------------------------------------------------------------------------------------


def test_layered_tests_load_with_the_shared_script_and_each_steps_files():
    task = load_task(LAYERED)
    assert [step.name for step in task.steps] == ["01-create", "02-extend"]
    for step in task.steps:
        assert step.tests_layers == (LAYERED / "tests", LAYERED / "steps" / step.name / "tests")
        assert step.tests_dir == LAYERED / "tests"  # the step has no test.sh of its own
    view = step_view(task, 1)
    assert view.instruction.startswith("Write to /app/b") and not view.steps
    assert view.solution_script == LAYERED / "steps" / "02-extend" / "solution" / "solve.sh"
    assert task.instruction == step_view(task, 0).instruction  # the task is its first step's view
    assert task.multi_step_reward == "mean" and task.steps[1].workdir_dir is not None


def test_own_tests_load_with_each_steps_script_deadlines_and_gate():
    task = load_task(OWN_TESTS)
    first, second = task.steps
    assert first.tests_layers == (OWN_TESTS / "steps" / "01-config" / "tests",)
    assert second.tests_dir == OWN_TESTS / "steps" / "02-report" / "tests"
    assert first.min_reward == 1.0 and second.min_reward is None
    assert (first.limits.agent_timeout_sec, first.limits.verifier_timeout_sec) == (120.0, 120.0)
    assert (second.limits.agent_timeout_sec, second.limits.verifier_timeout_sec) == (300.0, 60.0)
    assert task.multi_step_reward == "final"
    assert task.limits.total_timeout_sec >= sum(
        s.limits.agent_timeout_sec + s.limits.verifier_timeout_sec for s in task.steps
    )


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: (d / "steps" / "02-extend" / "instruction.md").unlink(), "instruction"),
        (lambda d: (d / "tests" / "test.sh").unlink(), "steps[1] tests"),
        (
            lambda d: _append(d, 'multi_step_reward_strategy = "best"\n', top=True),
            "multi_step_reward_strategy",
        ),
        (lambda d: _append(d, '[[steps]]\nname = "01-create"\n'), "steps[3].name"),
        (lambda d: _append(d, '[[steps]]\nname = "../escape"\n'), "steps[3].name"),
        (lambda d: _append(d, '[[steps]]\nname = "03"\nmin_reward = "high"\n'), "steps[3].min_reward"),
    ],
)
def test_malformed_steps_name_the_field(tmp_path, edit, field):
    task_dir = copy_task(LAYERED, tmp_path / "task")
    edit(task_dir)
    with pytest.raises(TaskLoadError) as raised:
        load_task(task_dir)
    assert raised.value.field == field


def _append(task_dir: Path, text: str, *, top: bool = False) -> None:
    path = task_dir / "task.toml"
    path.write_text(text + path.read_text() if top else path.read_text() + "\n" + text)


def test_setup_commands_put_the_workdir_files_and_run_setup(tmp_path):
    task = load_task(LAYERED)
    assert setup_commands(task, 0, workdir="/app") == []
    lines = setup_commands(task, 1, workdir=str(tmp_path))
    assert all(len(line) < 1200 and "\n" not in line for line in lines)
    for line in lines:  # the lines run by a plain bash reproduce what Harbor uploads and runs
        done = subprocess.run(["bash", "-c", line.replace("/tmp/.t1jax-step.b64", str(tmp_path / "a.b64"))])
        assert done.returncode == 0
    assert (tmp_path / "seed.txt").read_text() == "omega\n"


# -- rewards and gating --------------------------------------------------------------------------------


def test_rewards_mean_final_and_the_min_reward_gate():
    task = load_task(LAYERED)
    reports = [_report(1.0), _report(None, outcome=False, total=2)]
    assert trial_reward(task, reports) == {"reward": 0.5}
    assert trial_reward(task, [_report(1.0), _report(None)]) == {"reward": 1.0}  # no result: excluded
    own = load_task(OWN_TESTS)
    assert trial_reward(own, reports) == {"reward": 0.0}  # final: the last step's
    assert stops_after(own, 0, _report(0.0)) and not stops_after(own, 0, _report(1.0))
    assert not stops_after(task, 0, _report(0.0))  # no gate: go on
    assert stops_after(task, 0, _report(None))  # no verifier result: Harbor ends the trial
    combined = combined_report(own, [_report(0.0, passed=0)])
    assert [a.name for a in combined.assertions] == ["01-config::t0", "02-report::(not run)"]
    assert combined.binary_outcome is None and combined.reward_value == 0.0


_HARBOR_CHECK = textwrap.dedent(
    """
    import json, sys, types
    from harbor.models.task.config import TaskConfig
    from harbor.models.trial.result import StepResult
    from harbor.models.verifier.result import VerifierResult
    from harbor.trial.trial import Trial
    out = {}
    for path in sys.argv[1:]:
        config = TaskConfig.model_validate_toml(open(path + "/task.toml").read())
        out[path] = {
            "steps": [s.name for s in config.steps],
            "min_reward": [s.min_reward for s in config.steps],
            "strategy": getattr(config.multi_step_reward_strategy, "value", None),
        }
    rewards = json.loads(sys.stdin.read())
    results = [StepResult(step_name=str(i), verifier_result=None if r is None else VerifierResult(rewards=r))
               for i, r in enumerate(rewards)]
    fake = types.SimpleNamespace(result=types.SimpleNamespace(step_results=results))
    aggregated = Trial._aggregate_step_rewards(fake)
    out["mean"] = None if aggregated is None else aggregated.rewards
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not HARBOR_PYTHON.exists(), reason="Harbor's package is not set up (.venv-harbor)")
def test_harbor_reads_the_same_steps_and_averages_as_we_do():
    rewards = [{"reward": 1.0}, None, {"reward": 0.0, "style": 1.0}]
    done = subprocess.run(
        [str(HARBOR_PYTHON), "-c", _HARBOR_CHECK, str(LAYERED), str(OWN_TESTS)],
        input=json.dumps(rewards), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    harbor = json.loads(done.stdout)
    for path in (LAYERED, OWN_TESTS):
        ours = load_task(path)
        assert harbor[str(path)]["steps"] == [step.name for step in ours.steps]
        assert harbor[str(path)]["min_reward"] == [step.min_reward for step in ours.steps]
        assert (harbor[str(path)]["strategy"] or "mean") == ours.multi_step_reward
    reports = [
        _report(1.0),
        VerifierReport((), False, FailureCause.VERIFIER_TIMEOUT, None),
        _report(0.0),
    ]
    ours = trial_reward(load_task(LAYERED), reports)
    assert ours["reward"] == harbor["mean"]["reward"]  # Harbor's per-key mean over verified steps


# -- trials on the real backends ------------------------------------------------------------------------


def _run_steps(sandbox, task, *, solve: bool) -> list[VerifierReport]:
    reports = []
    workdir = sandbox.exec("pwd", 30).stdout.strip()
    for index in range(step_count(task)):
        for line in setup_commands(task, index, workdir=workdir):
            assert sandbox.exec(line, 60).exit_code == 0
        if solve:
            assert run_solution(step_view(task, index), sandbox).exit_code == 0
        reports.append(sandbox.verify())
        if stops_after(task, index, reports[-1]):
            break
    return reports


@pytest.mark.sandbox
def test_each_step_is_verified_in_turn_in_one_environment(any_backend):
    task = load_task(LAYERED)
    sandbox = any_backend.create(task)
    try:
        reports = _run_steps(sandbox, task, solve=True)
        with pytest.raises(SandboxError):  # the last step's verify ended the agent phase
            sandbox.exec("true", 10)
        with pytest.raises(SandboxError):
            sandbox.verify()
    finally:
        sandbox.close()
    assert [(r.passed, r.total, r.reward_value) for r in reports] == [(2, 2, 1.0), (3, 3, 1.0)]
    assert trial_reward(task, reports) == {"reward": 1.0}


@pytest.mark.sandbox
def test_a_failed_gate_ends_the_trial_and_the_final_strategy_scores_it(any_backend):
    task = load_task(OWN_TESTS)
    sandbox = any_backend.create(task)
    try:
        reports = _run_steps(sandbox, task, solve=False)
    finally:
        sandbox.close()
    assert len(reports) == 1 and reports[0].reward_value == 0.0
    assert combined_report(task, reports).total == 2 and trial_reward(task, reports) == {"reward": 0.0}


_BETWEEN_STEPS_ATTACK = (
    # Step 1's tests and the verifier's files, wherever they might be, and a planted pass for step 2.
    "find / -xdev \\( -name test_step.py -o -name 'ctrf.json' \\) 2>/dev/null | grep -v '^/proc' "
    "> /tmp/found; cat /tests/* >> /tmp/found 2>/dev/null; "
    "mkdir -p /tests /logs/verifier; "
    "printf 'import pytest\\n@pytest.hookimpl(hookwrapper=True)\\n"
    "def pytest_runtest_makereport(item, call):\\n"
    '    outcome = yield\\n    outcome.get_result().outcome = "passed"\\n\' > /tests/conftest.py; '
    "cp /tests/conftest.py /app/conftest.py; echo 1 > /logs/verifier/reward.txt; cat /tmp/found"
)


@pytest.mark.sandbox
def test_an_agent_tampering_between_steps_gains_nothing(any_backend, tmp_path):
    """After step 1's verification the agent looks for step 1's tests and the verifier's reports,
    plants a conftest that passes everything and a reward file, and the host's copy of step 2's
    tests is changed after the sandbox was made: step 2 is caught (the checksum), and without that
    change the planted files do not raise its score (2 of 3: the carried-over file and process)."""
    task_dir = copy_task(LAYERED, tmp_path / "task")
    task = load_task(task_dir)
    for tamper_host in (False, True):
        sandbox = any_backend.create(task)
        try:
            assert run_solution(step_view(task, 0), sandbox).exit_code == 0
            first = sandbox.verify()
            found = sandbox.exec(_BETWEEN_STEPS_ATTACK, 60)
            if tamper_host:
                (task_dir / "steps" / "02-extend" / "tests" / "test_step.py").write_text(
                    "def test_ok():\n    pass\n"
                )
            second = sandbox.verify()
        finally:
            sandbox.close()
        assert (first.passed, first.total) == (2, 2)
        assert found.stdout == "", f"the agent found the verifier's files: {found.stdout[:300]}"
        if tamper_host:
            assert (
                second.failure_cause == FailureCause.TESTS_TAMPERED
                and "changed test_step.py" in second.detail
            )
        else:
            assert second.parsed and (second.passed, second.total) == (2, 3) and second.reward_value == 0.0


@pytest.mark.sandbox
def test_steps_through_admission_control_and_the_http_service(backend, tmp_path):
    task = load_task(LAYERED)
    controller = AdmissionController(
        backend, AdmissionConfig(create_rate_per_sec=None, reaper_interval_sec=0.1)
    )
    thread = ServiceThread(create_app(controller, TaskStore(tmp_path / "store"), backend_name="test")).start()
    client = SandboxServiceClient(thread.url, timeout_margin_sec=30)
    try:
        for provider in (controller, client):
            sandbox = provider.create(task, run_id="multi-step")
            try:
                reports = _run_steps(sandbox, task, solve=True)
                with pytest.raises(SandboxError):
                    sandbox.exec("true", 10)
            finally:
                sandbox.close()
            assert [(r.passed, r.total) for r in reports] == [(2, 2), (3, 3)]
        assert backend.live_sandboxes("multi-step") == []
    finally:
        client.close()
        thread.stop()
        controller.shutdown()


@pytest.mark.sandbox
def test_check_tasks_judges_multi_step_tasks_and_reports_each_step(backend, tmp_path):
    pool = tmp_path / "pool"
    for source in (LAYERED, OWN_TESTS):
        copy_task(source, pool / source.name)
    audits = {audit.source_dir.name: audit for audit in check_tasks(pool, backend)}
    assert all(audit.sound for audit in audits.values()), [a.line() for a in audits.values()]
    layered = audits["multi-step"].to_json()
    assert [s["step"] for s in layered["solution"]["steps"]] == ["01-create", "02-extend"]
    assert layered["solution"]["reward"] == 1.0 and layered["noop"]["reward"] == 0.0
    gated = audits["multi-step-own-tests"]
    assert len(gated.noop.steps) == 1 and gated.noop.score() == "0/2"  # stopped at the gate


@pytest.mark.sandbox
def test_pids_stay_aligned_for_the_verifier_after_a_steps_verification(backend):
    """Local backend: the verifier's pid namespace is the agent's parent and both allocate in step;
    the first step's verifier took pids of the outer namespace only, so they are realigned: a
    process the agent starts in the next step has the same pid in both (what a pid file names)."""
    task = load_task(LAYERED)
    sandbox = backend.create(task)
    try:
        before = sandbox.exec("sleep 771 > /dev/null 2>&1 & echo $!", 30).stdout.strip()
        sandbox.verify()
        after = sandbox.exec("sleep 772 > /dev/null 2>&1 & echo $!", 30).stdout.strip()
        views = {}
        for pid in sandbox.cgroups.members():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if command.startswith(b"sleep\x0077"):
                nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
                views[command.split(b"\x00")[1].decode()] = nspid
    finally:
        sandbox.close()
    for name, pid in (("771", before), ("772", after)):
        host, outer, inner = views[name]
        assert outer == inner == pid, (name, views[name])
