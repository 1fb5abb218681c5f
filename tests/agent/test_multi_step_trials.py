"""Multi-step Harbor tasks through the harness on the real local sandbox (bubblewrap backend).

`tests/data/multi_step_tasks/three-steps`: three steps in one sandbox, the second with a
`workdir/setup.sh`, each with its own tests layered over a shared `test.sh`. The oracle plays
each step's reference solution; a scripted policy that does nothing in the middle step fails
exactly that step. Checked: each step's instruction reaches the model as a new user turn of
the same token stream (TITO stitches it with exact boundaries), every step is verified once by
the task's own tests, the trial's reward is Harbor's (mean or final), `min_reward` ends the trial
early, and a one-step task's prompt is what it was (no step header)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.backends.local import LocalBackend
from sandbox_service.client import SandboxServiceClient
from sandbox_service.server import ServiceThread, TaskStore, create_app
from sandbox_service.steps import trial_reward
from sandbox_service.tasks import load_task
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain
from t1jax.agent import prompts
from t1jax.agent.chat_template import render_tool_call_text
from t1jax.agent.harness import HarnessConfig, run_trial, verify_trial
from t1jax.agent.scripted import ScriptedSampler
from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.eval.agents import TaskBook, current_step, nop_policy, oracle_policy
from t1jax.rollout.types import SamplingParams
from t1jax.runtime.records import resolved
from t1jax.tito.assembler import assemble_trajectory
from t1jax.tito.types import BoundaryCase, TrialStatus

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "tests" / "data" / "multi_step_tasks" / "three-steps"
RUN_ID = "multi-step-harness-tests"
TOK = load_project_tokenizer()
SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.1, top_p=0.95, top_k=20)
CONFIG = HarnessConfig(
    context_window=16384,
    max_tokens_per_turn=2048,
    summary_max_tokens=512,
    min_turn_tokens=128,
    observation_reserve_tokens=128,
    max_turns=12,
    max_output_bytes=2000,
)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    toolchain = setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory
    provider = LocalBackend(cache_dir=tmp_path_factory.mktemp("sandbox-cache"), toolchain_dir=toolchain)
    yield provider
    leaked = provider.live_sandboxes(run_id=RUN_ID)
    provider.reap(run_id=RUN_ID)
    provider.close()
    assert not leaked, f"sandboxes left running: {leaked}"


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    """A real container (podman) backend; none of its containers is left at teardown."""
    from sandbox_service.backends.podman import PodmanBackend, PodmanConfig
    from sandbox_service.base_images import DEFAULT_STAND_IN_DIR

    toolchain = setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory
    config = PodmanConfig(cache_dir=tmp_path_factory.mktemp("container-cache"), toolchain_dir=toolchain,
                          stand_in_dir=DEFAULT_STAND_IN_DIR, pull="never")  # fmt: skip
    podman = PodmanBackend(config)
    yield podman
    podman.close()
    assert podman.own_containers() == [], "containers left behind"


def fail_step(index: int, book: TaskBook):
    """The oracle, except that in step `index` it declares the step complete at once."""
    oracle, nop = oracle_policy(book, max_command_sec=5.0), nop_policy()

    def policy(call):
        return nop(call) if current_step(call.prompt_text)[0] == index else oracle(call)

    return policy


def stall_step(index: int, book: TaskBook, command: str = "sleep 1"):
    """The oracle, except that in step `index` it runs `command` turn after turn, never completing."""
    oracle = oracle_policy(book, max_command_sec=5.0)

    def policy(call):
        if current_step(call.prompt_text)[0] == index:
            return "Still working.\n\n" + render_tool_call_text(
                "shell", {"command": command, "duration": "1"}
            )
        return oracle(call)

    return policy


def play(backend, task, make_policy, trial_id="trial", config=CONFIG):
    book = TaskBook()
    book.register(trial_id, task)
    sandbox = backend.create(task, run_id=RUN_ID)
    try:
        trajectory = run_trial(
            task, sandbox, ScriptedSampler(TOK, make_policy(book)), TOK, config, trial_id=trial_id,
            sampling=SAMPLING,
        )  # fmt: skip
        assert verify_trial(trajectory, sandbox) is trajectory  # the harness verified every step
    finally:
        sandbox.close()
    return trajectory


def variant(tmp_path, edit) -> Path:
    """A copy of the three-step task with its task.toml edited by `edit`."""
    copy = tmp_path / "three-steps"
    shutil.copytree(TASK, copy)
    toml = copy / "task.toml"
    toml.write_text(edit(toml.read_text()))
    return copy


def step_prompts(trajectory) -> list[str]:
    """The decoded prompt of each step's first turn."""
    turns = trajectory.turns
    return [TOK.decode(turns[step.first_turn].prompt_ids) for step in trajectory.step_reports]


def test_the_oracle_passes_every_step_and_each_instruction_is_a_new_user_turn(backend):
    task = load_task(TASK)
    trajectory = play(backend, task, lambda book: oracle_policy(book, max_command_sec=5.0))
    assert trajectory.status is TrialStatus.COMPLETED, trajectory.detail
    steps = trajectory.step_reports
    assert [s.name for s in steps] == ["01-write", "02-count", "03-finish"]
    assert [s.index for s in steps] == [0, 1, 2]
    assert all(s.rewards == {"reward": 1.0} and s.agent_status is TrialStatus.COMPLETED for s in steps)
    assert all(s.report.parsed and s.report.passed == s.report.total > 0 for s in steps)
    assert [s.report.total for s in steps] == [1, 2, 2]  # each step's own tests (the setup's among them)
    assert steps[0].first_turn == 0 < steps[1].first_turn < steps[2].first_turn
    report = trajectory.verifier_report
    assert report.reward_value == 1.0 and report.binary_outcome is True and resolved(report)
    assert {a.name.split("::")[0] for a in report.assertions} == {"01-write", "02-count", "03-finish"}
    assert trajectory.verify_sec == pytest.approx(sum(s.verify_sec for s in steps))
    # Each step's instruction, under its header, is the last user turn before its first reply,
    # and later steps keep the whole conversation before them (one stream, no compaction).
    texts = step_prompts(trajectory)
    for index, (text, step) in enumerate(zip(texts, task.steps, strict=True)):
        header = prompts.STEP_HEADER.format(number=index + 1, total=3, name=step.name)
        last_user = text.rsplit("<|im_start|>user\n", 1)[1]
        assert last_user.startswith(prompts.STEP_OVER if index else "Task description:\n" + header)
        assert header in last_user and step.instruction.strip() in last_user
        if index:
            assert text.startswith(texts[index - 1])
    assembly = assemble_trajectory(trajectory, 1.0, TOK)
    (sample,) = assembly.samples
    assert all(b.case is BoundaryCase.EXACT for b in assembly.boundaries)
    assert len(sample.tokens) == len(trajectory.turns[-1].prompt_ids) + len(
        trajectory.turns[-1].completion_ids
    )


def test_a_failed_middle_step_scores_zero_and_the_trial_goes_on(backend):
    task = load_task(TASK)
    trajectory = play(backend, task, lambda book: fail_step(1, book))
    steps = trajectory.step_reports
    assert [s.rewards for s in steps] == [{"reward": 1.0}, {"reward": 0.0}, {"reward": 1.0}]
    assert (
        steps[1].report.passed == 1 and steps[1].report.total == 2
    )  # setup ran, the count was never written
    report = trajectory.verifier_report
    # Harbor's "mean" over the verified steps; resolved only when every step resolved.
    assert report.reward_value == pytest.approx(2 / 3)
    assert report.reward_value == trial_reward(task, [s.report for s in steps])["reward"]
    assert report.binary_outcome is False and not resolved(report)
    assert trajectory.status is TrialStatus.COMPLETED


def test_the_steps_through_admission_control_and_the_http_service(backend, tmp_path):
    """The service's step API (each `verify` opens the next step's agent phase) drives the same
    trial to the same per-step results as the backend in process."""
    task = load_task(TASK)
    controller = AdmissionController(
        backend, AdmissionConfig(create_rate_per_sec=None, reaper_interval_sec=0.1)
    )
    thread = ServiceThread(
        create_app(controller, TaskStore(tmp_path / "store"), backend_name="local")
    ).start()
    client = SandboxServiceClient(thread.url, timeout_margin_sec=30)
    try:
        trajectory = play(client, task, lambda book: fail_step(1, book))
    finally:
        client.close()
        thread.stop()
        controller.shutdown()
    assert [s.rewards["reward"] for s in trajectory.step_reports] == [1.0, 0.0, 1.0]
    assert trajectory.verifier_report.reward_value == pytest.approx(2 / 3)
    assert backend.live_sandboxes(RUN_ID) == []


def test_a_failed_middle_step_on_the_container_backend(container):
    """The same trial in a real container built from the task's Dockerfile: files and the
    workdir's setup carried across steps, each step verified in turn."""
    trajectory = play(container, load_task(TASK), lambda book: fail_step(1, book))
    assert [s.rewards["reward"] for s in trajectory.step_reports] == [1.0, 0.0, 1.0]
    assert trajectory.step_reports[1].report.passed == 1  # setup.sh ran in the container
    assert trajectory.verifier_report.reward_value == pytest.approx(2 / 3)


def test_a_step_ended_by_its_own_deadline_is_verified_and_the_next_step_gets_its_own(backend, tmp_path):
    path = variant(
        tmp_path,
        lambda t: t.replace('name = "01-write"', 'name = "01-write"\n[steps.agent]\ntimeout_sec = 4'),
    )
    task = load_task(path)
    assert task.steps[0].limits.agent_timeout_sec == 4
    trajectory = play(backend, task, lambda book: stall_step(0, book))
    first, *rest = trajectory.step_reports
    assert first.agent_status is TrialStatus.AGENT_TIMEOUT and first.rewards == {"reward": 0.0}
    assert [s.agent_status for s in rest] == [TrialStatus.COMPLETED] * 2, [s.agent_detail for s in rest]
    assert [s.rewards["reward"] for s in rest] == [1.0, 0.0]  # 03-finish needs the file 01 never wrote
    assert trajectory.status is TrialStatus.COMPLETED
    assembly = assemble_trajectory(trajectory, 0.0, TOK)
    assert all(b.case is BoundaryCase.EXACT for b in assembly.boundaries)


def test_through_the_scheduler_each_step_gets_its_own_deadline(backend, tmp_path):
    """The trial scheduler over admission control: the first step (4 s) runs out, the second
    (its own 300 s) needs more than the first step had and still completes; the scheduler takes
    the harness's verification of every step as the trial's."""
    from t1jax.rl.reward import RewardConfig
    from t1jax.runtime.scheduler import TrialFate, TrialScheduler, TrialSpec

    path = variant(
        tmp_path,
        lambda t: t.replace('name = "01-write"', 'name = "01-write"\n[steps.agent]\ntimeout_sec = 4'),
    )
    task = load_task(path)
    book = TaskBook()
    book.register("sched", task)
    slow_second = lambda call: 1.5 if current_step(call.prompt_text)[0] == 1 else 0.0  # noqa: E731
    sampler = ScriptedSampler(TOK, stall_step(0, book), delay_sec=slow_second)
    controller = AdmissionController(
        backend, AdmissionConfig(create_rate_per_sec=None, reaper_interval_sec=0.1)
    )
    try:
        with TrialScheduler(sampler=sampler, sandboxes=controller, tokenizer=TOK, harness=CONFIG,
                            reward=RewardConfig(), run_id=RUN_ID, concurrency=1) as scheduler:  # fmt: skip
            (trial,) = scheduler.run([TrialSpec("sched", task, SAMPLING, 1)])
    finally:
        controller.shutdown()
    assert trial.fate is TrialFate.COMPLETED, (trial.cause, trial.detail)
    steps = trial.trajectory.step_reports
    assert [s.agent_status for s in steps] == [
        TrialStatus.AGENT_TIMEOUT,
        TrialStatus.COMPLETED,
        TrialStatus.COMPLETED,
    ]
    assert steps[1].agent_sec > 4.5 and steps[1].rewards == {"reward": 1.0}
    # scored on every step's assertions: 01 none of 1, 02 both, 03 none of 2 (01 never wrote one.txt)
    assert (trial.reward.passed, trial.reward.total, trial.reward.binary_outcome) == (2, 5, False)
    assert trial.timings.verify == pytest.approx(trial.trajectory.verify_sec)


def test_max_turns_applies_to_each_step(backend):
    config = dataclasses.replace(CONFIG, max_turns=5)
    trajectory = play(backend, load_task(TASK), lambda book: stall_step(1, book, command=""), config=config)
    steps = trajectory.step_reports
    assert [s.agent_status for s in steps] == [
        TrialStatus.COMPLETED,
        TrialStatus.MAX_TURNS,
        TrialStatus.COMPLETED,
    ]
    assert steps[1].action_turns == 5 and trajectory.stats.action_turns == sum(s.action_turns for s in steps)
    assert [s.rewards["reward"] for s in steps] == [1.0, 0.0, 1.0]


def test_min_reward_ends_the_trial_after_the_failed_step(backend, tmp_path):
    path = variant(
        tmp_path, lambda text: text.replace('name = "02-count"', 'name = "02-count"\nmin_reward = 1.0')
    )
    task = load_task(path)
    assert task.steps[1].min_reward == 1.0
    trajectory = play(backend, task, lambda book: fail_step(1, book))
    assert [s.name for s in trajectory.step_reports] == ["01-write", "02-count"]
    assert "stopped after step 02-count (2 of 3)" in trajectory.detail
    report = trajectory.verifier_report
    assert report.reward_value == pytest.approx(0.5) and report.binary_outcome is False
    assert "03-finish::(not run)" in [a.name for a in report.assertions if not a.passed]
    # The step that never ran was never shown to the model.
    assert task.steps[2].instruction.strip() not in TOK.decode(trajectory.turns[-1].prompt_ids)


def test_a_failed_step_setup_ends_the_trial_as_harbor_does(backend, tmp_path):
    path = variant(tmp_path, lambda text: text)
    (path / "steps" / "02-count" / "workdir" / "setup.sh").write_text(
        "#!/bin/bash\necho broken >&2\nexit 3\n"
    )
    task = load_task(path)
    trajectory = play(backend, task, lambda book: oracle_policy(book, max_command_sec=5.0))
    assert [s.name for s in trajectory.step_reports] == ["01-write"]
    assert "02-count's setup exited 3: broken" in trajectory.detail
    report = trajectory.verifier_report
    # Harbor: the step that never ran has no verifier result and counts in no mean
    assert report.reward_value == 1.0 and report.binary_outcome is False and not resolved(report)
    assert {a.name for a in report.assertions if not a.passed} == {
        "02-count::(not run)",
        "03-finish::(not run)",
    }
    assert task.steps[1].instruction.strip() not in TOK.decode(trajectory.turns[-1].prompt_ids)


def test_the_final_strategy_scores_the_last_step(backend, tmp_path):
    path = variant(tmp_path, lambda text: text.replace('"mean"', '"final"'))
    task = load_task(path)
    assert task.multi_step_reward == "final"
    trajectory = play(backend, task, lambda book: fail_step(1, book))
    report = trajectory.verifier_report
    assert [s.rewards["reward"] for s in trajectory.step_reports] == [1.0, 0.0, 1.0]
    assert report.reward_value == 1.0 and report.binary_outcome is False and not resolved(report)


def test_a_one_step_task_shows_no_step_header(backend):
    task = load_task(REPO / "tests" / "data" / "tasks" / "harbor" / "hello-world")
    book = TaskBook()
    book.register("one", task)
    sandbox = backend.create(task, run_id=RUN_ID)
    try:
        trajectory = run_trial(
            task, sandbox, ScriptedSampler(TOK, nop_policy()), TOK, CONFIG, trial_id="one", sampling=SAMPLING
        )
        assert trajectory.verifier_report is None and trajectory.step_reports == ()
        trajectory = verify_trial(trajectory, sandbox)
    finally:
        sandbox.close()
    assert trajectory.verifier_report is not None and trajectory.step_reports == ()
    assert "[step " not in TOK.decode(trajectory.turns[0].prompt_ids)
