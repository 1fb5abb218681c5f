"""Full trials on the real local sandbox (bubblewrap backend) with scripted policies.

Three trials, each verified by the task's own tests and then stitched and audited: a policy that
solves the task, one that emits garbage, and one that fills the context until it is compacted and
then solves the task from its summary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sandbox_service.backends.local import LocalBackend
from sandbox_service.tasks import load_task
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain
from t1jax.agent.harness import HarnessConfig, run_trial, verify_trial
from t1jax.agent.metrics import trial_metrics
from t1jax.agent.scripted import ScriptedSampler
from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.rollout.types import SamplingParams
from t1jax.tito.assembler import assemble_trajectory
from t1jax.tito.types import BoundaryCase, TrialStatus, TurnKind
from tests.agent import policies

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "tasks" / "harbor"
RUN_ID = "harness-tests"
TOK = load_project_tokenizer()
SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.1, top_p=0.95, top_k=20)
CONFIG = HarnessConfig(
    context_window=8192,
    max_tokens_per_turn=1024,
    summary_max_tokens=512,
    min_turn_tokens=128,
    observation_reserve_tokens=128,
    max_turns=10,
    max_output_bytes=2000,
)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """A real local backend (bubblewrap must be installed: these tests fail, not skip, without it)
    using the repository's pinned verifier toolchain, created on first use."""
    toolchain = setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory
    provider = LocalBackend(cache_dir=tmp_path_factory.mktemp("sandbox-cache"), toolchain_dir=toolchain)
    yield provider
    leaked = provider.live_sandboxes(run_id=RUN_ID)
    provider.reap(run_id=RUN_ID)
    provider.close()
    assert not leaked, f"sandboxes left running: {leaked}"


def trial(backend, task_name: str, policy, config=CONFIG, trial_id="trial"):
    task = load_task(TASKS / task_name)
    sandbox = backend.create(task, run_id=RUN_ID)
    try:
        trajectory = run_trial(
            task, sandbox, ScriptedSampler(TOK, policy), TOK, config, trial_id=trial_id, sampling=SAMPLING
        )
        trajectory = verify_trial(trajectory, sandbox)
    finally:
        sandbox.close()
    report = trajectory.verifier_report
    reward = report.passed / report.total if report.parsed and report.total else 0.0
    return trajectory, assemble_trajectory(trajectory, reward, TOK), reward


def test_scripted_policy_solves_a_task_in_the_sandbox(backend):
    # 1 s waits: the test reads the terminal output, which a loaded machine may print late.
    policy = policies.solver(["echo 'Hello, world!' > /app/hello.txt", "cat /app/hello.txt"], duration=1.0)
    trajectory, assembly, reward = trial(backend, "hello-world", policy)
    assert trajectory.status is TrialStatus.COMPLETED, trajectory.detail
    assert reward == 1.0 and trajectory.verifier_report.total == 2
    assert "Hello, world!" in TOK.decode(trajectory.turns[2].prompt_ids[trajectory.turns[2].glue_start :])
    (sample,) = assembly.samples
    assert all(r.case is BoundaryCase.EXACT for r in assembly.boundaries)
    assert assembly.audit.drift_in_loss_region == 0 and sample.reward == 1.0
    np.testing.assert_array_equal(sample.routing[:, 0, 0], np.arange(len(sample.tokens) - 1))


def test_garbage_policy_runs_nothing_and_fails_verification(backend):
    trajectory, assembly, reward = trial(backend, "hello-world", policies.garbage(TOK))
    assert trajectory.status is TrialStatus.MAX_TURNS, trajectory.detail
    assert trajectory.stats.parse_errors == CONFIG.max_turns and trajectory.stats.commands_run == 0
    assert trajectory.verifier_report.parsed and reward == 0.0
    assert assembly.audit.drift_in_loss_region == 0
    assert assembly.audit.loss_tokens == sum(len(t.completion_ids) for t in trajectory.turns)


# The task's reference solution minus its shebang and `set` line, typed into the terminal.
SOLVE_SALES = (TASKS / "sales-report" / "solution" / "solve.sh").read_text().split("\n", 2)[2]


def compacting_policy():
    """Explores with large and binary outputs until compacted, then solves from its summary."""
    explore = [
        "cat /app/data/sales.csv",
        "seq 1 3000",
        "head -c 1500 /dev/urandom",
        "seq 5000 9000",
        "ls -la /app /app/data",
        "seq 1 4000",
    ]

    def policy(call):
        last = call.last_user_text
        if "context window is almost full" in last:
            return (
                "Summary: I looked at /app/data/sales.csv (columns region,product,units,unit_price; some "
                "units empty) and printed long number sequences. Next: write /app/clean.csv and the JSON "
                "report at $REPORT_PATH with a python script."
            )
        if "Are you sure" in last:
            return "Yes.\n\n" + policies.complete()
        if "Your earlier context was compacted" in call.prompt_text:
            if '"total_units": 28' in last:
                return "The report is written.\n\n" + policies.complete()
            if policies.previous_replies(call) == 0:
                return "Writing the outputs now.\n\n" + policies.shell(SOLVE_SALES, 2.0)
            return "Checking.\n\n" + policies.shell("cat /app/clean.csv; cat $REPORT_PATH", 1.0)
        step = policies.previous_replies(call) % len(explore)
        # 1 s per command: on a loaded machine a shorter wait can read a command's output before
        # it is printed, and the exploration then takes more turns to fill the context.
        return f"Exploring (step {step}).\n\n" + policies.shell(explore[step], 1.0)

    return policy


def test_context_compaction_then_solving_from_the_summary(backend):
    config = HarnessConfig(
        context_window=4096,
        max_tokens_per_turn=1024,
        summary_max_tokens=256,
        min_turn_tokens=128,
        observation_reserve_tokens=128,
        max_turns=24,  # headroom for a loaded machine, where exploration can take more turns
        max_output_bytes=800,
        recent_output_bytes=200,
    )
    trajectory, assembly, reward = trial(backend, "sales-report", compacting_policy(), config=config)
    assert trajectory.status is TrialStatus.COMPLETED, trajectory.detail
    assert trajectory.compactions and all(e.succeeded for e in trajectory.compactions)
    assert len(trajectory.segments) == len(trajectory.compactions) + 1
    assert trajectory.segments[0].turns[-1].kind is TurnKind.SUMMARY
    assert reward == 1.0, trajectory.verifier_report
    assert len(assembly.samples) == len(trajectory.segments)
    assert all(s.reward == 1.0 for s in assembly.samples)
    assert assembly.audit.drift_in_loss_region == 0
    assert assembly.audit.loss_tokens == sum(len(t.completion_ids) for t in trajectory.turns)
    metrics = trial_metrics([trajectory])
    assert (
        metrics["compaction/failure_rate"] == 0.0 and metrics["compaction/summary_chars_kept_fraction"] == 1.0
    )
