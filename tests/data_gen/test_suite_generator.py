"""The synthetic task suite: determinism, the family split, task format, and soundness in real sandboxes.

The soundness tests run `sandbox_service.check_tasks` (the same audit as `python -m sandbox_service
check-tasks`) in bubblewrap sandboxes: on a sample of generated tasks that covers every idiom
(reference passes all, no-op fails some), and on one task per (idiom, mistake) whose solution is
replaced by the mistake (it must fail at least one assertion, or RL could not learn to avoid it).
The whole-suite audit of a demo-sized suite is marked slow.
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sandbox_service.backends.local import LocalBackend
from sandbox_service.check_tasks import check_tasks
from sandbox_service.envbuild import check_environment
from sandbox_service.tasks import load_dataset
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain
from t1jax.agent.tokenizer import load_project_tokenizer
from t1jax.data.idioms import CATEGORIES, IDIOMS, MISTAKE_NAMES, SLOT_WORDS, Slots
from t1jax.data.suite import (
    CATEGORY_WEIGHTS,
    SuiteConfig,
    SuiteTask,
    check_split,
    generate_suite,
    make_families,
    plan_tasks,
    select_families,
    write_task,
)

REPO = Path(__file__).resolve().parents[2]


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(oct(path.stat().st_mode & 0o777).encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite") / "suite"
    manifest = generate_suite(out, SuiteConfig(n=200, seed=11))
    return out, manifest


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    toolchain = setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory
    local = LocalBackend(cache_dir=tmp_path_factory.mktemp("sandbox-cache"), toolchain_dir=toolchain)
    yield local
    leaked = local.live_sandboxes()
    local.close()
    assert not leaked, leaked


def test_slot_words_are_single_tokens():
    """The copy lever: every slot word is one token after a space and after a slash."""
    tokenizer = load_project_tokenizer()
    for word in SLOT_WORDS:
        assert len(tokenizer.encode_text(f" {word}")) == 1, word
        assert len(tokenizer.encode_text(f"/{word}")) == 1, word


def test_the_mistake_catalogue_is_every_name_a_generated_task_offers(suite):
    """MISTAKE_NAMES (what a demonstrator habit may name) is slot-independent: an idiom's steps
    name the same mistakes whatever their slot values, and a suite offers only those."""
    for idiom in IDIOMS:
        names = {tuple(m.name for m in idiom.make(Slots(random.Random(seed))).mistakes) for seed in range(20)}
        assert len(names) == 1, idiom.name
    out, _ = suite
    offered = {m["name"] for plan in out.glob("*/*/solution/plan.json")
               for step in json.loads(plan.read_text())["steps"] for m in step["mistakes"]}  # fmt: skip
    assert offered and offered <= MISTAKE_NAMES
    assert "sed-without-i" in MISTAKE_NAMES and "no-chmod" in MISTAKE_NAMES


def test_generation_is_deterministic_in_the_seed(tmp_path, suite):
    out, _ = suite
    generate_suite(tmp_path / "again", SuiteConfig(n=200, seed=11))
    generate_suite(tmp_path / "other", SuiteConfig(n=200, seed=12))
    assert tree_digest(tmp_path / "again") == tree_digest(out)
    assert tree_digest(tmp_path / "other") != tree_digest(out)


def test_split_is_disjoint_by_family_and_held_out_idioms_are_taught(suite):
    _, manifest = suite
    families = {f["family_id"]: f for f in manifest["families"]}
    by_split = collections.defaultdict(set)
    for task in manifest["tasks"]:
        assert families[task["family"]]["split"] == task["split"]
        by_split[task["split"]].add(task["family"])
    assert by_split["train"] and by_split["heldout"]
    assert not by_split["train"] & by_split["heldout"]
    train_idioms = {i for t in manifest["tasks"] if t["split"] == "train" for i in t["idioms"]}
    heldout_idioms = {i for t in manifest["tasks"] if t["split"] == "heldout" for i in t["idioms"]}
    assert heldout_idioms <= train_idioms
    # every category has both train and held-out families, for every seed tried
    for seed in range(5):
        made = make_families(seed)
        check_split(made)
        for category in CATEGORIES:
            splits = {f.split for f in made if f.category == category}
            assert splits == {"train", "heldout"}, (seed, category)


def test_heldout_tasks_sets_the_count_apart_from_the_family_share():
    """The demo's split: 2 families of 12 per category held out, but only 64 held-out tasks."""
    families = make_families(0, heldout_fraction=0.2)
    tasks = plan_tasks(families, 1260, 0, heldout_fraction=0.2, heldout_tasks=64)
    heldout = [t for t in tasks if t.family.split == "heldout"]
    assert len(heldout) == 64 and len(tasks) == 1260
    per_category = collections.Counter(f.category for f in families if f.split == "heldout")
    assert set(per_category.values()) == {2}, per_category
    # every held-out family gets tasks (the category's tasks go over its families in turn)
    assert {t.family.family_id for t in heldout} == {f.family_id for f in families if f.split == "heldout"}
    # without it, the fraction sets both
    planned = plan_tasks(families, 1260, 0, heldout_fraction=0.2)
    assert sum(t.family.split == "heldout" for t in planned) == 252
    for bad in (0, 1260):
        with pytest.raises(ValueError, match="heldout_tasks"):
            plan_tasks(families, 1260, 0, heldout_tasks=bad)


def test_heldout_per_family_takes_k_tasks_of_every_family_and_leaves_the_train_tasks_alone():
    """The demo's split since 2026-12-06: one task of every held-out family. The train tasks are
    the very ones a suite with the same number of train tasks and any other held-out choice has
    (each split draws from its own stream), so a finished run's SFT and RL stand unchanged."""
    families = make_families(3, families_per_category=10, heldout_fraction=0.4)
    heldout_families = sorted(f.family_id for f in families if f.split == "heldout")
    assert 16 <= len(heldout_families) <= 32  # up to 4 of 10 a category, as idiom coverage allows
    for k in (1, 2):
        tasks = plan_tasks(families, 300, 3, heldout_per_family=k)
        heldout = collections.Counter(t.family.family_id for t in tasks if t.family.split == "heldout")
        assert sorted(heldout) == heldout_families and set(heldout.values()) == {k}
        assert len(tasks) == 300
        train = [t for t in tasks if t.family.split == "train"]
        same_count = plan_tasks(families, 300, 3, heldout_tasks=300 - len(train))
        assert train == [t for t in same_count if t.family.split == "train"]
    for kwargs, message in (
        ({"heldout_per_family": 1, "heldout_tasks": 30}, "not both"),
        ({"heldout_per_family": 0}, "heldout_per_family must be an integer >= 1"),
        ({"heldout_per_family": True}, "heldout_per_family must be an integer >= 1"),
        ({"heldout_per_family": 11}, "tasks leaves no train task of n = 300"),
    ):
        with pytest.raises(ValueError, match=message):
            plan_tasks(families, 300, 3, **kwargs)


def test_category_mix_follows_the_paper_pool(suite):
    _, manifest = suite
    counts = collections.Counter(t["category"] for t in manifest["tasks"])
    assert set(counts) == set(CATEGORIES) and len(CATEGORIES) >= 8
    total = sum(CATEGORY_WEIGHTS.values())
    for category, weight in CATEGORY_WEIGHTS.items():
        # each split is rounded on its own: at most one task off per split
        assert abs(counts[category] - 200 * weight / total) <= 2, (category, counts[category])
    assert counts["scripting"] == max(counts.values())


def test_tasks_are_well_formed_harbor_tasks(suite):
    out, manifest = suite
    for split in ("train", "heldout"):
        dataset = load_dataset(out / split, environment_check=check_environment)
        assert not dataset.errors, dataset.errors[:3]
        assert len(dataset) == sum(t["split"] == split for t in manifest["tasks"])
    inspection = 0
    for entry in manifest["tasks"]:
        directory = out / entry["path"]
        meta = tomllib.loads((directory / "task.toml").read_text())["metadata"]
        assert meta["category"] == entry["category"] and meta["required_steps"] == entry["required_steps"]
        plan = json.loads((directory / "solution" / "plan.json").read_text())
        steps = sum(len(s["inspect"]) + len(s["actions"]) for s in plan["steps"])
        assert steps == entry["required_steps"]  # difficulty = number of required steps
        assert meta["difficulty"] == ("easy" if steps <= 2 else "medium" if steps <= 4 else "hard")
        tests = (directory / "tests" / "test_outputs.py").read_text()
        assert 2 <= tests.count("\ndef test_") == entry["checks"] <= 12
        instruction = (directory / "instruction.md").read_text()
        assert instruction.count("\n") == len(plan["steps"]) + 1  # a header and one line per step
        # inspection steps: the value the action uses is not in the instruction
        for step in plan["steps"]:
            if step["inspect"]:
                inspection += 1
        assert "plan.json" not in tests and not (directory / "environment" / "plan.json").exists()
    assert inspection >= 20


def test_cli_writes_a_suite_and_refuses_bad_input(tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "t1jax.cli", "tasks", "generate", *args],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip

    done = cli("--out", str(tmp_path / "s"), "--n", "30", "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert "wrote 30 tasks" in done.stdout and (tmp_path / "s" / "manifest.json").is_file()
    again = cli("--out", str(tmp_path / "s"), "--n", "30")
    assert (
        again.returncode == 2 and "not an empty directory" in again.stderr and "Traceback" not in again.stderr
    )
    tiny = cli("--out", str(tmp_path / "t"), "--n", "1")
    assert tiny.returncode == 2 and "at least 2 tasks" in tiny.stderr and not (tmp_path / "t").exists()
    fraction = cli("--out", str(tmp_path / "u"), "--n", "10", "--heldout-fraction", "1.5")
    assert fraction.returncode == 2 and "heldout_fraction" in fraction.stderr
    count = cli("--out", str(tmp_path / "v"), "--n", "10", "--heldout-tasks", "10")
    assert count.returncode == 2 and "heldout_tasks" in count.stderr and not (tmp_path / "v").exists()
    per_family = cli("--out", str(tmp_path / "w"), "--n", "30", "--heldout-per-family", "0")
    assert per_family.returncode == 2 and not (tmp_path / "w").exists()
    assert per_family.stderr.strip().splitlines() == [
        "t1jax tasks generate: error: heldout_per_family must be an integer >= 1, got 0"
    ]


def test_a_narrower_pool_caps_each_category_and_covers_what_the_cap_allows(suite):
    out, manifest = suite
    train = {f["family_id"]: f for f in manifest["families"] if f["split"] == "train"}
    everything = select_families(manifest, "train", 100)
    assert sorted(everything) == sorted(train)  # no cap: every family, once
    for cap, seed in ((1, 0), (2, 0), (2, 5)):
        chosen = select_families(manifest, "train", cap, seed)
        assert chosen == select_families(manifest, "train", cap, seed)
        assert len(set(chosen)) == len(chosen) and set(chosen) <= set(train)
        per_category = collections.Counter(train[f]["category"] for f in chosen)
        available = collections.Counter(f["category"] for f in train.values())
        assert per_category == {c: min(cap, n) for c, n in available.items()}, (cap, per_category)
        # The cover comes first, in the order picked: each pick teaches the most idioms not yet
        # taught of any family whose category still had room.
        uncovered, taken = {i for f in train.values() for i in f["idioms"]}, collections.Counter()
        for pick in chosen:
            gain = len(uncovered & set(train[pick]["idioms"]))
            if gain == 0:
                break
            room = [f for f in train if f not in taken and taken[train[f]["category"]] < cap]
            assert gain == max(len(uncovered & set(train[f]["idioms"])) for f in room), (cap, pick)
            taken[pick] = 1
            taken[train[pick]["category"]] += 1
            uncovered -= set(train[pick]["idioms"])
        # ... which teaches at least as many idioms as any of 50 random picks under the same cap
        covered = len({i for f in chosen for i in train[f]["idioms"]})
        draws = random.Random(cap)
        for _ in range(50):
            families = [
                f
                for c in available
                for f in draws.sample(
                    sorted(f for f in train if train[f]["category"] == c), min(cap, available[c])
                )
            ]
            assert covered >= len({i for f in families for i in train[f]["idioms"]})
    assert select_families(manifest, "train", 2, 0) != select_families(manifest, "train", 2, 5)
    with pytest.raises(ValueError, match="at least 1"):
        select_families(manifest, "train", 0)


def test_cli_writes_a_subset_and_refuses_bad_input(tmp_path, suite):
    out, manifest = suite

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "t1jax.cli", "tasks", "subset", "--suite", str(out), *args],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip

    done = cli("--out", str(tmp_path / "pool"), "--families-per-category", "2", "--seed", "1")
    assert done.returncode == 0, done.stderr
    subset = json.loads((tmp_path / "pool" / "manifest.json").read_text())
    chosen = select_families(manifest, "train", 2, 1)
    assert subset["subset_of"]["families"] == chosen
    assert [t["task_id"] for t in subset["tasks"]] == [
        t["task_id"] for t in manifest["tasks"] if t["family"] in chosen
    ]
    assert f"wrote {len(subset['tasks'])} tasks of {len(chosen)} train families" in done.stdout
    # the copies are the suite's task directories, byte for byte, and load as a dataset
    for task in subset["tasks"]:
        assert tree_digest(tmp_path / "pool" / task["path"]) == tree_digest(out / task["path"])
    assert sorted(t.task_id for t in load_dataset(tmp_path / "pool" / "train")) == sorted(
        t["task_id"] for t in subset["tasks"]
    )
    again = cli("--out", str(tmp_path / "pool"), "--families-per-category", "2")
    assert (
        again.returncode == 2 and "not an empty directory" in again.stderr and "Traceback" not in again.stderr
    )
    zero = cli("--out", str(tmp_path / "z"), "--families-per-category", "0")
    assert zero.returncode == 2 and "at least 1" in zero.stderr and not (tmp_path / "z").exists()
    missing = subprocess.run(
        [sys.executable, "-m", "t1jax.cli", "tasks", "subset", "--suite", str(tmp_path), "--out",
         str(tmp_path / "m"), "--families-per-category", "2"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "not a suite" in missing.stderr and "Traceback" not in missing.stderr


def idiom_cover(manifest: dict) -> list[dict]:
    """A few tasks (train and held-out) that together use every idiom."""
    chosen, seen = [], set()
    remaining = list(manifest["tasks"])
    while remaining:
        best = max(remaining, key=lambda t: (len(set(t["idioms"]) - seen), t["task_id"]))
        if not set(best["idioms"]) - seen:
            break
        chosen.append(best)
        seen |= set(best["idioms"])
        remaining.remove(best)
    assert seen == {i.name for i in IDIOMS}
    return chosen


@pytest.mark.sandbox
def test_a_sample_covering_every_idiom_is_sound(suite, backend, tmp_path):
    out, manifest = suite
    sample = tmp_path / "sample"
    for task in idiom_cover(manifest):
        shutil.copytree(out / task["path"], sample / task["path"])
    audits = check_tasks(sample, backend, run_id="suite-sample")
    assert audits and all(a.sound for a in audits), [a.line() for a in audits if not a.sound]


@pytest.mark.sandbox
def test_every_mistake_fails_a_check(backend, tmp_path):
    """One single-step task per (idiom, mistake) whose solve.sh runs the mistake: the verifier must
    catch it (a reward that cannot see a mistake cannot teach RL to avoid it)."""
    from t1jax.data.suite import Family

    pool = tmp_path / "mistakes"
    expected = {}
    rng = random.Random(5)
    for idiom in IDIOMS:
        step = idiom.make(Slots(rng))
        assert step.mistakes, idiom.name
        for mistake in step.mistakes:
            task_id = f"mistake/{idiom.name}-{mistake.name}"
            family = Family("m", idiom.category, (idiom.name,), "train")
            write_task(SuiteTask(task_id, family, (step,)), pool / f"{idiom.name}-{mistake.name}")
            solve = pool / f"{idiom.name}-{mistake.name}" / "solution" / "solve.sh"
            solve.write_text("#!/bin/bash\n" + "".join(f"{c}\n" for c in mistake.actions))
            expected[task_id] = len(step.checks)
    audits = check_tasks(pool, backend, run_id="suite-mistakes")
    assert len(audits) == len(expected)
    for audit in audits:
        assert audit.solution is not None and audit.solution.parsed, audit.line()
        assert audit.solution.total == expected[audit.task_id]
        assert audit.solution.passed < audit.solution.total, f"mistake not caught: {audit.line()}"
        # the task's `--tb=line`: each failed check leaves one `path:line: Exception...` line in
        # the verifier's log, and no long traceback (its frame separators)
        failed = audit.solution.total - audit.solution.passed
        locations = re.findall(r"(?m)^/\S+:\d+: \w", audit.solution.output_tail)
        assert len(locations) == failed, (audit.line(), audit.solution.output_tail[-2000:])
        assert "_ _ _ _" not in audit.solution.output_tail


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_demo_sized_suite_is_sound(backend, tmp_path):
    out = tmp_path / "suite"
    generate_suite(out, SuiteConfig(n=500, seed=0))
    audits = check_tasks(out, backend, run_id="suite-all")
    assert len(audits) == 500
    assert all(a.sound for a in audits), [a.line() for a in audits if not a.sound][:5]
