"""The SFT warm start: demonstrator scripts, demonstrations in real sandboxes, `t1jax sft` end to end.

- Scripts follow the task's plan, use mistakes at the idiom's rate, and every reply parses into
  exactly the planned shell call (checked with the harness's own parser).
- Demonstrations run through the real harness in bubblewrap sandboxes: the verifier sees the
  mistakes (a demonstration without one resolves the task, one with a mistake does not), the
  stitched samples carry no routing, and their loss tokens are exactly the demonstrator's replies.
- `t1jax sft` on a small suite writes metrics, a summary and a checkpoint that
  `t1jax.model.from_pretrained` loads; the loss falls; bad input exits 2 with one line.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.backends.local import LocalBackend
from sandbox_service.tasks import load_task
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain
from t1jax.agent.harness import HarnessConfig
from t1jax.agent.parsing import parse_reply
from t1jax.agent.prompts import PROMPT_PROFILES
from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.data.idioms import MISTAKE_NAMES
from t1jax.data.suite import SuiteConfig, generate_suite
from t1jax.sft.demonstrator import CONFIRM_REPLY, DONE_REPLY, load_plan, script_for
from t1jax.sft.demos import check_habits, collect_demonstrations
from t1jax.sft.train import DemoConfig
from t1jax.tito.types import TrialStatus

REPO = Path(__file__).resolve().parents[2]
HARNESS = HarnessConfig(
    terminal="exec",
    prompt_profile="compact-once",  # the demo's
    max_turns=12,
    max_tokens_per_turn=96,
    context_window=1024,
    compaction=False,
    min_turn_tokens=64,
    observation_reserve_tokens=64,
    summary_max_tokens=64,
    max_output_bytes=1000,
    default_command_duration_sec=10.0,
)

PLAN = {
    "task_id": "suite/x",
    "steps": [
        {"number": 1, "idiom": "a", "sentence": "Move the only file in /app/in to /app/out.",
         "inspect": ["ls /app/in"], "actions": ["mv /app/in/f /app/out/"],
         "mistake_rate": 0.3, "mistakes": [{"name": "copy", "actions": ["cp /app/in/f /app/out/"]}]},
        {"number": 2, "idiom": "b", "sentence": "Count the lines of /app/a into /app/b.",
         "inspect": [], "actions": ["wc -l < /app/a > /app/b"],
         "mistake_rate": 0.0, "mistakes": [{"name": "name", "actions": ["wc -l /app/a > /app/b"]}]},
    ],
}  # fmt: skip


def commands_of(reply: str) -> list[str]:
    parsed = parse_reply(reply, default_duration_sec=1.0, max_duration_sec=60.0)
    assert parsed.ok, parsed.errors
    return [c.command for c in parsed.commands]


def test_scripts_follow_the_plan_at_the_mistake_rate():
    rng = random.Random(0)
    scripts = [script_for(PLAN, rng) for _ in range(2000)]
    rate = sum(bool(s.mistakes) for s in scripts) / len(scripts)
    assert abs(rate - 0.3) < 0.04  # binomial sd 0.01
    for script in scripts[:50]:
        assert [commands_of(r) for r in script.replies][0] == ["ls /app/in"]  # inspection first
        expected = "cp /app/in/f /app/out/" if script.mistakes == ((1, "copy"),) else "mv /app/in/f /app/out/"
        assert [commands_of(r) for r in script.replies][1:] == [[expected], ["wc -l < /app/a > /app/b"]]
        notes = [reply.split("\n\n", 1)[0] for reply in script.replies]
        assert notes == [
            "Step 1: Move the only file in /app/in to /app/out. I look first.",
            "Step 1: Move the only file in /app/in to /app/out. Now I act.",
            "Step 2: Count the lines of /app/a into /app/b.",
        ]
    assert script_for(PLAN, random.Random(7)) == script_for(PLAN, random.Random(7))
    done = parse_reply(DONE_REPLY, default_duration_sec=1.0, max_duration_sec=60.0)
    assert done.ok and done.task_complete and not done.commands


def test_a_habit_replaces_the_idioms_rate_wherever_a_step_offers_its_mistake():
    rng = random.Random(1)
    # step 2's idiom never errs (rate 0), but its mistake is a habit: made at the habit's rate
    scripts = [script_for(PLAN, rng, {"name": 0.7}) for _ in range(2000)]
    step2 = sum((2, "name") in s.mistakes for s in scripts) / len(scripts)
    step1 = sum((1, "copy") in s.mistakes for s in scripts) / len(scripts)
    assert abs(step2 - 0.7) < 0.04 and abs(step1 - 0.3) < 0.04  # binomial sd 0.01
    for script in scripts[:50]:
        expected = "wc -l /app/a > /app/b" if (2, "name") in script.mistakes else "wc -l < /app/a > /app/b"
        assert commands_of(script.replies[-1]) == [expected]
    # a habit at 0 is a step done right always, whatever the idiom's rate
    assert not any(script_for(PLAN, rng, {"copy": 0.0}).mistakes for _ in range(200))
    assert script_for(PLAN, random.Random(7), {}) == script_for(PLAN, random.Random(7))
    with pytest.raises(ValueError, match=r"habits.name: a rate in \[0, 1\], got 1.5"):
        DemoConfig(habits={"name": 1.5})


@pytest.fixture(scope="module")
def toolchain():
    return setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite") / "suite"
    generate_suite(out, SuiteConfig(n=16, seed=4))
    return out


def with_mistake_rate(task_dir: Path, target: Path, rate: float) -> Path:
    """A copy of a suite task whose every step errs with probability `rate`."""
    shutil.copytree(task_dir, target)
    plan_path = target / "solution" / "plan.json"
    plan = json.loads(plan_path.read_text())
    for step in plan["steps"]:
        step["mistake_rate"] = rate
    plan_path.write_text(json.dumps(plan))
    return target


def test_a_misspelt_habit_is_refused_before_any_sandbox_and_a_known_one_these_tasks_lack_is_not(suite):
    tasks = [load_task(path) for path in sorted((suite / "train").iterdir())[:4]]
    with pytest.raises(ValueError, match=r"habits \['sed-without-l'\]: no idiom and no step of these 4"):
        collect_demonstrations(tasks, None, load_project_tokenizer(), HARNESS, seed=0,
                               habits={"sed-without-l": 0.9})  # fmt: skip
    plans = [load_plan(task) for task in tasks]
    offered = {m["name"] for plan in plans for step in plan["steps"] for m in step["mistakes"]}
    lacking = sorted(MISTAKE_NAMES - offered)
    assert lacking  # 4 tasks offer a few of the idioms' mistakes, not all of them
    check_habits(plans, {lacking[0]: 0.7})  # a config's habits hold for any suite, a small one too
    # a mistake only a task's own plan offers (not one of the idioms') is known through the plan
    plans[0]["steps"][0]["mistakes"].append({"name": "handmade", "actions": ["true"]})
    check_habits(plans, {"handmade": 0.7})


@pytest.mark.sandbox
def test_demonstrations_run_in_real_sandboxes(suite, toolchain, tmp_path):
    tokenizer = load_project_tokenizer()
    source = sorted((suite / "train").iterdir())[0]
    clean = load_task(with_mistake_rate(source, tmp_path / "clean", 0.0))
    faulty = load_task(with_mistake_rate(source, tmp_path / "faulty", 1.0))
    backend = LocalBackend(cache_dir=tmp_path / "cache", toolchain_dir=toolchain)
    sandboxes = AdmissionController(backend, AdmissionConfig(max_live_sandboxes=2, create_rate_per_sec=None))
    try:
        demos = collect_demonstrations([clean, faulty], sandboxes, tokenizer, HARNESS, seed=0, verify=True)
        assert not sandboxes.leak_check("sft-demos").leaked
    finally:
        sandboxes.shutdown()
        backend.close()
    good, bad = demos
    for demo in demos:
        assert demo.status is TrialStatus.COMPLETED, demo.detail
        assert len(demo.samples) == 1 and demo.samples[0].routing is None
    assert not good.mistakes and good.resolved and good.passed == good.total
    assert len(bad.mistakes) == len(json.loads((source / "solution" / "plan.json").read_text())["steps"])
    assert not bad.resolved and bad.passed < bad.total
    # The loss tokens are the demonstrator's replies (each closed by <|im_end|>), nothing else.
    plan = json.loads((tmp_path / "clean" / "solution" / "plan.json").read_text())
    confirms = PROMPT_PROFILES[HARNESS.prompt_profile].confirmation is not None
    ending = (DONE_REPLY, CONFIRM_REPLY) if confirms else (DONE_REPLY,)
    replies = script_for(plan, random.Random(f"0/{clean.task_id}/0")).replies + ending
    sample = good.samples[0]
    mask = np.asarray(sample.loss_mask, bool)
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]])) + 1
    texts = [tokenizer.decode(sample.tokens[a:b]) for a, b in zip(starts, ends, strict=True)]
    assert texts == [reply + "<|im_end|>" for reply in replies]


def sft_config(tmp_path: Path) -> Path:
    config = {
        "model": str(REPO / "configs" / "tiny_cpu.yaml"),
        "seed": 0,
        "harness": {**{k: v for k, v in vars(HARNESS).items() if k in (
            "max_turns", "max_tokens_per_turn", "context_window", "compaction", "min_turn_tokens",
            "observation_reserve_tokens", "summary_max_tokens", "max_output_bytes",
            "default_command_duration_sec", "prompt_profile")}, "terminal": "exec"},
        "demonstrations": {"per_task": 1, "workers": 2, "verify": True},
        "training": {"epochs": 2, "batch_samples": 4, "row_length_buckets": [1024], "rows_per_micro_batch": 2,
                     "learning_rate": 3e-3, "decay_to_zero": True},
    }  # fmt: skip
    path = tmp_path / "sft.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def run_cli(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "t1jax.cli", "sft", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=900,
    )


@pytest.mark.sandbox
def test_sft_cli_end_to_end(suite, toolchain, tmp_path):
    import jax.numpy as jnp

    from t1jax.model import from_pretrained, load_config

    tasks = tmp_path / "tasks"
    for task_dir in sorted((suite / "train").iterdir())[:6]:
        shutil.copytree(task_dir, tasks / task_dir.name)
    # The two halves apart, as the demo runs them: demonstrations, then training on them.
    demos, out = tmp_path / "demos", tmp_path / "run"
    collected = run_cli("--config", str(sft_config(tmp_path)), "--tasks", str(tasks), "--out", str(demos),
                        "--collect-only")  # fmt: skip
    assert collected.returncode == 0, collected.stderr[-3000:]
    assert "demonstrations 6/6" in collected.stderr and not (demos / "checkpoint").exists()
    done = run_cli("--config", str(sft_config(tmp_path)), "--demonstrations", str(demos), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "demonstrations: 6 from" in done.stderr and "SFT done" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["demonstrations_from"] == str(demos.resolve())
    assert summary["samples"] == json.loads((demos / "summary.json").read_text())["samples"] == 6
    assert summary["demonstrations"] == 6 and summary["failed_demonstrations"] == 0
    assert summary["verified_demonstrations"] == 6 and 0 < summary["verified_mean_reward"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 5))  # 2 epochs x 6 samples / 4 per step
    # decay_to_zero: the rate falls linearly over the run's 4 steps
    assert [line["learning_rate"] for line in lines] == pytest.approx([3e-3, 2.25e-3, 1.5e-3, 0.75e-3])
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert len((demos / "demonstrations.jsonl").read_text().splitlines()) == 6
    model = from_pretrained(out / "checkpoint", dtype=jnp.float32)
    assert model.config == load_config(REPO / "configs" / "tiny_cpu.yaml")
    # Nothing already done is lost: the same --out is refused.
    again = run_cli("--config", str(sft_config(tmp_path)), "--tasks", str(tasks), "--out", str(out))
    assert again.returncode == 2 and "not empty" in again.stderr and "Traceback" not in again.stderr
    # Demonstrations run with another harness teach another prompt: refused, naming the difference.
    other = json.loads(sft_config(tmp_path).read_text())
    other["harness"]["max_turns"] += 1
    (tmp_path / "other.yaml").write_text(json.dumps(other))
    mismatch = run_cli("--config", str(tmp_path / "other.yaml"), "--demonstrations", str(demos),
                       "--out", str(tmp_path / "other"))  # fmt: skip
    assert mismatch.returncode == 2 and "another harness (differs in ['max_turns'])" in mismatch.stderr


def test_sft_cli_rejects_bad_input(tmp_path, suite):
    config = sft_config(tmp_path)
    missing = run_cli(
        "--config", str(config), "--tasks", str(tmp_path / "nope"), "--out", str(tmp_path / "o")
    )
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  epoch: 3\n")
    typo = run_cli("--config", str(bad), "--tasks", str(tmp_path), "--out", str(tmp_path / "o"))
    assert typo.returncode == 2 and "training.epoch: unknown key" in typo.stderr
    # a value of the wrong kind is refused before any sandbox starts, naming the key (`3e-3` is a
    # number: t1jax.yamlio reads YAML 1.2's exponent floats)
    bad.write_text("training:\n  learning_rate: fast\n")
    kind = run_cli("--config", str(bad), "--tasks", str(tmp_path), "--out", str(tmp_path / "o"))
    assert kind.returncode == 2 and "training.learning_rate: must be a number" in kind.stderr
    assert "Traceback" not in missing.stderr + typo.stderr + kind.stderr
    neither = run_cli("--config", str(config), "--out", str(tmp_path / "o"))
    assert neither.returncode == 2 and "give --tasks" in neither.stderr
    both = run_cli("--config", str(config), "--tasks", str(tmp_path), "--demonstrations", str(tmp_path),
                   "--out", str(tmp_path / "o"))  # fmt: skip
    assert both.returncode == 2 and "--demonstrations replaces --tasks" in both.stderr
    empty = run_cli("--config", str(config), "--demonstrations", str(tmp_path / "nope"),
                    "--out", str(tmp_path / "o"))  # fmt: skip
    assert empty.returncode == 2 and "no config.json, demonstrations.jsonl, samples.npz" in empty.stderr
    bad.write_text("demonstrations:\n  habits: {sed-without-l: 0.7}\n")  # a misspelt mistake name
    habit = run_cli("--config", str(bad), "--tasks", str(suite / "train"), "--collect-only",
                    "--out", str(tmp_path / "o"))  # fmt: skip
    assert habit.returncode == 2 and "habits ['sed-without-l']: no idiom and no step of these" in habit.stderr
    assert "Traceback" not in habit.stderr
    bad.write_text("seed: 0\n")  # neither model: nor init: (there is no default model)
    nomodel = run_cli("--config", str(bad), "--tasks", str(suite / "train"), "--out", str(tmp_path / "o"))
    assert nomodel.returncode == 2 and "needs model: (a preset or config.json) or init:" in nomodel.stderr
    assert not (tmp_path / "o").exists()  # nothing written by a refused run


def test_saved_demonstration_samples_load_field_for_field(tmp_path):
    from t1jax.sft.demos import load_samples, save_samples
    from t1jax.tito.types import AuditCounts, Sample

    rng = np.random.default_rng(0)
    samples = []
    for i, n in enumerate((5, 2, 9)):
        mask = (rng.random(n) < 0.5).astype(np.int8)
        mask[0] = 0
        samples.append(Sample(
            tokens=rng.integers(0, 2048, n).astype(np.int32), loss_mask=mask,
            sampler_logprobs=-rng.random(n).astype(np.float32), routing=None, reward=0.25 * i,
            task_id=f"suite/t{i}", trajectory_id=f"demo-{i}", segment_index=i, policy_version=0,
            audit=AuditCounts(aligned=n, loss_tokens=int(mask.sum())), fork_index=i % 2,
        ))  # fmt: skip
    save_samples(tmp_path / "samples.npz", samples)
    loaded = load_samples(tmp_path / "samples.npz")
    assert len(loaded) == 3
    for a, b in zip(samples, loaded, strict=True):
        for name in ("tokens", "loss_mask", "sampler_logprobs"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert getattr(a, name).dtype == getattr(b, name).dtype
        assert (a.reward, a.task_id, a.trajectory_id, a.segment_index, a.fork_index, a.audit) == (
            b.reward, b.task_id, b.trajectory_id, b.segment_index, b.fork_index, b.audit)  # fmt: skip
    assert not list(tmp_path.glob("*.partial*"))
