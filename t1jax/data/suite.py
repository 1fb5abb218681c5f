"""The synthetic task suite: template families, the train / held-out split, Harbor task directories.

`generate_suite(out, n, seed)` writes `n` tasks in Harbor layout under `out/train/` and
`out/heldout/`, plus `out/manifest.json`. The demo trains on the first split and evaluates on the
second.

- A *template family* is a category and an ordered tuple of 1-3 idioms (`t1jax.data.idioms`);
  a task of that family has one numbered instruction step per idiom, with fresh slot values and
  environment contents. A family's category is its first idiom's; later idioms may come from any
  category (cross-category composition).
- Categories are drawn with the weights of the paper's pool (§3.1, Figure 3): scripting 17.9%,
  software development 16.5%, system administration 13.8%, environment setup 10.4%, version
  control 9.3%; the remaining 32.1% (data science, debugging, performance and smaller
  categories) is split over data processing, file operations and debugging.
- The split is by family: each category's families are divided between train and held-out, and
  every idiom of a held-out family also occurs in some train family, so held-out tasks need no
  skill the train split does not teach (new combinations and positions of the same idioms,
  new slot values), and what RL improves on train can transfer. Each task names its family
  (`metadata.family`, loaded as `Task.family`), and evaluation intervals resample families.
- Difficulty is the number of required steps (commands of the reference solution, inspection
  commands included): `metadata.required_steps`; `metadata.difficulty` buckets it
  (easy <= 2 < medium <= 4 < hard).

Each task directory holds, besides the Harbor files, `solution/plan.json`: the steps with their
inspection commands, actions and the idiom's mistakes and mistake rate, which the demonstrator
(`t1jax.sft.demonstrator`) reads. The agent never sees `solution/`.

Invariants: the output is a pure function of the `SuiteConfig` (n, seed, heldout_fraction,
heldout_tasks or heldout_per_family, families_per_category)
(one `random.Random` per purpose, derived from the seed; files written in a fixed order); task
ids are unique; no family is in both splits.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import random
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from t1jax.data.idioms import CATEGORIES, IDIOMS, IDIOMS_BY_NAME, EnvFile, Slots, Step

SUITE_VERSION = 1
SPLITS = ("train", "heldout")

# Share of the suite per category (percent; paper Figure 3, see the module docstring).
CATEGORY_WEIGHTS: Mapping[str, float] = {
    "scripting": 17.9,
    "software-development": 16.5,
    "system-administration": 13.8,
    "environment-setup": 10.4,
    "version-control": 9.3,
    "data-processing": 12.0,
    "file-operations": 12.0,
    "debugging": 8.1,
}
FAMILY_LENGTH_WEIGHTS = {1: 0.25, 2: 0.45, 3: 0.30}
CROSS_CATEGORY_PROBABILITY = 0.3
BASE_IMAGE = "python:3.11-slim"
# A task that runs git (a repository built in its Dockerfile, or git in its solution or tests)
# needs the non-slim image, which has git as the official python:3.11 does (slim has none).
GIT_BASE_IMAGE = "python:3.11"
AGENT_TIMEOUT_SEC = 300.0
VERIFIER_TIMEOUT_SEC = 60.0


@dataclass(frozen=True)
class Family:
    """A template family: tasks of it share the category and the ordered idioms."""

    family_id: str
    category: str
    idioms: tuple[str, ...]
    split: str


@dataclass(frozen=True)
class SuiteTask:
    """One generated task, before it is written: its family, index and steps."""

    task_id: str
    family: Family
    steps: tuple[Step, ...]

    @property
    def required_steps(self) -> int:
        return sum(step.required_steps for step in self.steps)

    @property
    def num_checks(self) -> int:
        return sum(len(step.checks) for step in self.steps)

    @property
    def directory_name(self) -> str:
        return self.task_id.split("/", 1)[-1]


def difficulty_of(required_steps: int) -> str:
    if required_steps <= 2:
        return "easy"
    return "medium" if required_steps <= 4 else "hard"


def _rng(seed: int, purpose: str) -> random.Random:
    """An independent stream per purpose, so changing one use of randomness moves no other."""
    digest = hashlib.sha256(f"t1jax-suite/{SUITE_VERSION}/{seed}/{purpose}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


# ------------------------------------------------------------------------------------------------
# Families and the split


def make_families(
    seed: int, *, families_per_category: int = 12, heldout_fraction: float = 0.2
) -> list[Family]:
    """`families_per_category` distinct families per category, split train / held-out by family
    (at least one of each per category), every held-out idiom covered by a train family."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    if families_per_category < 2:
        raise ValueError(f"families_per_category must be >= 2, got {families_per_category}")
    rng = _rng(seed, "families")
    by_category = {c: [i for i in IDIOMS if i.category == c] for c in CATEGORIES}
    families: list[Family] = []
    for category in CATEGORIES:
        own = by_category[category]
        chosen: list[tuple[str, ...]] = []
        attempts = 0
        while len(chosen) < families_per_category and attempts < 10_000:
            attempts += 1
            length = rng.choices(list(FAMILY_LENGTH_WEIGHTS), weights=list(FAMILY_LENGTH_WEIGHTS.values()))[0]
            idioms = [rng.choice(own).name]
            while len(idioms) < length:
                pool = IDIOMS if rng.random() < CROSS_CATEGORY_PROBABILITY else own
                candidate = rng.choice(pool).name
                if candidate not in idioms:
                    idioms.append(candidate)
            if tuple(idioms) not in chosen:
                chosen.append(tuple(idioms))
        heldout = _choose_heldout(chosen, heldout_fraction, rng)
        prefix = "".join(part[0] for part in category.split("-"))
        for index, idioms in enumerate(chosen):
            split = "heldout" if index in heldout else "train"
            families.append(Family(f"{prefix}{index:02d}", category, idioms, split))
    return families


def _choose_heldout(families: Sequence[tuple[str, ...]], fraction: float, rng: random.Random) -> set[int]:
    """Indices of held-out families: about `fraction` of them, never leaving an idiom of a
    held-out family without a train family that uses it (families tried in a seeded random order,
    so held-out difficulty follows the train split's)."""
    target = max(1, min(len(families) - 1, round(fraction * len(families))))
    order = list(range(len(families)))
    rng.shuffle(order)
    heldout: set[int] = set()
    for index in order:
        if len(heldout) == target:
            break
        trial = heldout | {index}
        train_idioms = {name for i, f in enumerate(families) if i not in trial for name in f}
        if all(name in train_idioms for i in trial for name in families[i]):
            heldout = trial
    if not heldout:
        raise ValueError("could not hold out any family without losing an idiom from train")
    return heldout


def check_split(families: Sequence[Family]) -> None:
    """Raise unless every idiom of a held-out family occurs in a train family."""
    train = {name for f in families if f.split == "train" for name in f.idioms}
    for family in families:
        missing = [name for name in family.idioms if name not in train]
        if family.split == "heldout" and missing:
            raise ValueError(f"held-out family {family.family_id} uses {missing}, never seen in train")


# ------------------------------------------------------------------------------------------------
# Tasks


def _allocate(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Largest-remainder rounding of `total` over `weights` (deterministic tie order)."""
    norm = sum(weights.values())
    exact = {key: total * w / norm for key, w in weights.items()}
    counts = {key: int(value) for key, value in exact.items()}
    leftovers = sorted(weights, key=lambda key: (-(exact[key] - counts[key]), key))
    for key in leftovers[: total - sum(counts.values())]:
        counts[key] += 1
    return counts


def plan_tasks(
    families: Sequence[Family],
    n: int,
    seed: int,
    *,
    heldout_fraction: float = 0.2,
    heldout_tasks: int | None = None,
    heldout_per_family: int | None = None,
) -> list[SuiteTask]:
    """`n` tasks: `heldout_tasks` (by default round(n * heldout_fraction)) held-out, the rest
    train; each split's tasks are spread over categories by `CATEGORY_WEIGHTS` and over a
    category's families in turn. With `heldout_per_family` K instead, every held-out family has
    exactly K tasks (a category's share of the held-out tasks is its share of the held-out
    families) and the other n - K x families are train tasks. Each split draws from its own
    stream: the train tasks depend on their count, never on how the held-out ones are chosen."""
    if n < 2:
        raise ValueError(f"a suite needs at least 2 tasks (one per split), got n = {n}")
    heldout_families = collections.Counter(f.category for f in families if f.split == "heldout")
    if heldout_per_family is not None:
        if heldout_tasks is not None:
            raise ValueError("set heldout_tasks or heldout_per_family, not both")
        k, held_out = heldout_per_family, sum(heldout_families.values())
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"heldout_per_family must be an integer >= 1, got {k!r}")
        num_heldout = k * held_out
        if num_heldout > n - 1:
            raise ValueError(
                f"heldout_per_family {k} x {held_out} held-out families = {num_heldout} tasks "
                f"leaves no train task of n = {n}"
            )
    elif heldout_tasks is None:
        num_heldout = min(n - 1, max(1, round(n * heldout_fraction)))
    elif 1 <= heldout_tasks <= n - 1:
        num_heldout = heldout_tasks
    else:
        raise ValueError(f"heldout_tasks must lie in [1, n - 1] = [1, {n - 1}], got {heldout_tasks}")
    counts = {"train": n - num_heldout, "heldout": num_heldout}
    tasks: list[SuiteTask] = []
    for split in SPLITS:
        rng = _rng(seed, f"tasks/{split}")
        if split == "heldout" and heldout_per_family is not None:
            per_category = {c: heldout_per_family * heldout_families[c] for c in CATEGORIES}
        else:
            per_category = _allocate(counts[split], CATEGORY_WEIGHTS)
        for category in CATEGORIES:
            pool = [f for f in families if f.split == split and f.category == category]
            order = list(pool)
            rng.shuffle(order)
            for index in range(per_category[category]):
                family = order[index % len(order)]
                slots = Slots(rng)
                steps = []
                for name in family.idioms:
                    slots.begin_step()
                    steps.append(IDIOMS_BY_NAME[name].make(slots))
                task_id = f"suite/{split}-{family.family_id}-{index:04d}"
                tasks.append(SuiteTask(task_id, family, tuple(steps)))
    return tasks


def instruction_text(steps: Sequence[Step]) -> str:
    header = "Do this step:" if len(steps) == 1 else f"Do these {len(steps)} steps in order:"
    return "\n".join([header, *(f"{i}. {step.sentence}" for i, step in enumerate(steps, start=1))]) + "\n"


PLAN_FILE = "plan.json"  # in the task's solution/ directory, beside solve.sh


def plan_json(task: SuiteTask) -> dict:
    """The demonstrator's script (`solution/plan.json`): per step, what to run and how it may go wrong."""
    return {
        "task_id": task.task_id,
        "steps": [
            {
                "number": number,
                "idiom": step.idiom,
                "sentence": step.sentence,
                "inspect": list(step.inspect),
                "actions": list(step.actions),
                "mistake_rate": IDIOMS_BY_NAME[step.idiom].mistake_rate,
                "mistakes": [{"name": m.name, "actions": list(m.actions)} for m in step.mistakes],
            }
            for number, step in enumerate(task.steps, start=1)
        ],
    }


_TEST_PREAMBLE = '''"""Checks of a generated task: one test per requirement, reported separately."""

import importlib.util
import os
import stat
import subprocess
import tarfile
from pathlib import Path


def run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)


def git(repository, *argv):
    return run("git", "-c", "safe.directory=*", "-C", repository, *argv)


def load_module(path):
    spec = importlib.util.spec_from_file_location("checked_" + Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
'''


# A generated test is named after the step it checks: test_step{N}_{check} (N from 1, as the
# plan numbers its steps). pytest reports it under a node prefix (`test_outputs::`).
_STEP_TEST = re.compile(r"(?:^|::)test_step(\d+)_")


def test_file_text(steps: Sequence[Step]) -> str:
    parts = [_TEST_PREAMBLE]
    for number, step in enumerate(steps, start=1):
        for check in step.checks:
            body = "\n".join(f"    {line}" for line in check.body.splitlines())
            parts.append(f"\n\ndef test_step{number}_{check.name}():\n{body}\n")
    return "".join(parts)


def step_of_test(test_name: str) -> int | None:
    """The plan step a generated test checks (`test_file_text`'s names, with or without pytest's
    node prefix), or None for a test this suite did not write."""
    match = _STEP_TEST.search(test_name)
    return int(match.group(1)) if match else None


def dockerfile_text(steps: Sequence[Step]) -> str:
    tops = sorted({_top(f.path) for step in steps for f in step.files})
    lines = [f"FROM {base_image(steps)}", "WORKDIR /app"]
    lines += [f"COPY {top}/ /{top}/" for top in tops]
    lines += [f"RUN {command}" for step in steps for command in step.build]
    return "\n".join(lines) + "\n"


def base_image(steps: Sequence[Step]) -> str:
    commands = [c for step in steps for c in (*step.build, *step.inspect, *step.actions)]
    commands += [check.body for step in steps for check in step.checks]
    uses_git = any(re.search(r"\bgit\b", command) for command in commands)
    return GIT_BASE_IMAGE if uses_git else BASE_IMAGE


def _top(container_path: str) -> str:
    top = container_path.strip("/").split("/", 1)[0]
    if top not in ("app", "root"):
        raise ValueError(f"environment file {container_path} is outside /app and /root")
    return top


def task_toml_text(task: SuiteTask) -> str:
    tags = ", ".join(json.dumps(step.idiom) for step in task.steps)
    return (
        'schema_version = "1.1"\n\n'
        f"[task]\nname = {json.dumps(task.task_id)}\n\n"
        "[metadata]\n"
        f"difficulty = {json.dumps(difficulty_of(task.required_steps))}\n"
        f"category = {json.dumps(task.family.category)}\n"
        f"required_steps = {task.required_steps}\n"
        f"family = {json.dumps(task.family.family_id)}\n"
        f"split = {json.dumps(task.family.split)}\n"
        f"tags = [{tags}]\n\n"
        f"[verifier]\ntimeout_sec = {VERIFIER_TIMEOUT_SEC}\n\n"
        f"[agent]\ntimeout_sec = {AGENT_TIMEOUT_SEC}\n\n"
        "[environment]\ncpus = 1\nmemory_mb = 256\nstorage_mb = 64\nallow_internet = false\n"
        'workdir = "/app"\n'
    )


def solve_sh_text(steps: Sequence[Step]) -> str:
    """The reference solution: every action (inspections are skipped: it knows the values)."""
    commands = [action for step in steps for action in step.actions]
    return "#!/bin/bash\nset -euo pipefail\n" + "".join(f"{c}\n" for c in commands)


# The task's own verifier command. `--tb=line`: one line per failure (where it failed and the
# assertion's explanation) instead of pytest's long tracebacks, which list the source of every
# frame. It changes the log only, never an outcome. Those tracebacks cost ~0.02 CPU s per failed
# check: ~0.1 of the ~0.45 CPU s of a verification where most checks fail (a no-op agent), ~4% of
# an evaluation's CPU at the trained policy's ~1.3 failed checks a trial (docs/history/demo.md),
# and a `make demo` verifies ~3,000 trials on 2 cores. Each check is its own test, so its name in
# the `-rA` summary already says what failed.
TEST_SCRIPT = (
    "#!/bin/bash\n"
    "# Runs the checks with the pytest on PATH, one report entry per test and one line per failure.\n"
    "pytest /tests/test_outputs.py -rA --tb=line\n"
)


def write_task(task: SuiteTask, directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "task.toml").write_text(task_toml_text(task))
    (directory / "instruction.md").write_text(instruction_text(task.steps))
    environment = directory / "environment"
    environment.mkdir()
    (environment / "Dockerfile").write_text(dockerfile_text(task.steps))
    for step in task.steps:
        for env_file in step.files:
            _write_env_file(environment, env_file)
    tests = directory / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text(TEST_SCRIPT)
    (tests / "test.sh").chmod(0o755)
    (tests / "test_outputs.py").write_text(test_file_text(task.steps))
    solution = directory / "solution"
    solution.mkdir()
    (solution / "solve.sh").write_text(solve_sh_text(task.steps))
    (solution / "solve.sh").chmod(0o755)
    (solution / PLAN_FILE).write_text(json.dumps(plan_json(task), indent=1) + "\n")


def _write_env_file(environment: Path, env_file: EnvFile) -> None:
    target = environment / env_file.path.lstrip("/")
    if target.exists():
        raise ValueError(f"two steps write the environment file {env_file.path}")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(env_file.content)
    target.chmod(env_file.mode)


# ------------------------------------------------------------------------------------------------
# The whole suite


@dataclass(frozen=True)
class SuiteConfig:
    """What a suite is a function of. `heldout_fraction` is the share of each category's families
    held out and, unless `heldout_tasks` or `heldout_per_family` is set, the share of tasks:
    setting either measures transfer over more families for the same evaluation cost (fewer tasks
    per family). `heldout_per_family` K: exactly K tasks of every held-out family (at most one of
    the two)."""

    n: int
    seed: int
    heldout_fraction: float = 0.2
    families_per_category: int = 12
    heldout_tasks: int | None = None
    heldout_per_family: int | None = None


def generate_suite(
    out: str | Path,
    config: SuiteConfig,
    *,
    on_task: Callable[[int, int, SuiteTask], None] | None = None,
) -> dict:
    """Write the suite to `out` (which must not exist or be empty); returns the manifest."""
    out = Path(out)
    _check_new_directory(out)
    families = make_families(
        config.seed,
        families_per_category=config.families_per_category,
        heldout_fraction=config.heldout_fraction,
    )
    check_split(families)
    tasks = plan_tasks(
        families,
        config.n,
        config.seed,
        heldout_fraction=config.heldout_fraction,
        heldout_tasks=config.heldout_tasks,
        heldout_per_family=config.heldout_per_family,
    )
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        raise FileExistsError(f"{staging} exists (an interrupted generation?); remove it first")
    staging.mkdir(parents=True)
    for index, task in enumerate(tasks):
        write_task(task, staging / task.family.split / task.directory_name)
        if on_task is not None:
            on_task(index + 1, len(tasks), task)
    manifest = manifest_of(config, families, tasks)
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    _move_into_place(staging, out)
    return manifest


def _check_new_directory(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose a new --out")


def _move_into_place(staging: Path, out: Path) -> None:
    """The finished `staging` becomes `out` (absent or empty): a suite appears whole or not at all."""
    if out.exists():
        out.rmdir()
    staging.rename(out)


def read_manifest(suite: str | Path) -> dict:
    """The manifest of the suite at `suite`, or a ValueError saying it is not one."""
    path = Path(suite) / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{suite} is not a suite (no manifest.json; see `t1jax tasks generate`)")
    return json.loads(path.read_text())


def manifest_of(config: SuiteConfig, families: Sequence[Family], tasks: Sequence[SuiteTask]) -> dict:
    return {
        "suite_version": SUITE_VERSION,
        "config": dataclasses.asdict(config),
        "category_weights": dict(CATEGORY_WEIGHTS),
        "idioms": {i.name: {"category": i.category, "mistake_rate": i.mistake_rate} for i in IDIOMS},
        "families": [dataclasses.asdict(f) for f in families],
        "tasks": [
            {
                "task_id": t.task_id,
                "path": f"{t.family.split}/{t.directory_name}",
                "split": t.family.split,
                "family": t.family.family_id,
                "category": t.family.category,
                "idioms": list(t.family.idioms),
                "required_steps": t.required_steps,
                "difficulty": difficulty_of(t.required_steps),
                "checks": t.num_checks,
                "inspection": any(step.inspect for step in t.steps),
            }
            for t in tasks
        ],
    }


def select_families(manifest: Mapping, split: str, per_category: int, seed: int = 0) -> list[str]:
    """Up to `per_category` of `split`'s families in each category, covering as many of the split's
    idioms as the cap allows: first a greedy cover (each pick the family with the most idioms not
    yet covered, ties broken by a seeded draw), then seeded draws fill each category to the cap.
    A pure function of its arguments; the ids come back in the order picked.

    Why a narrower pool: RL's critic is the only baseline (paper §5), and a step's batch drawn from
    a few families shows it each family again and again, so it can learn the per-family return
    that otherwise dominates the reward's variance (README, "The demo")."""
    if per_category < 1:
        raise ValueError(f"families per category must be at least 1, not {per_category}")
    families = {f["family_id"]: f for f in manifest["families"] if f["split"] == split}
    if not families:
        raise ValueError(f"the suite has no {split!r} families")
    rng = _rng(seed, "select_families")
    draw = {family_id: rng.random() for family_id in sorted(families)}
    uncovered = {idiom for f in families.values() for idiom in f["idioms"]}
    chosen: list[str] = []
    taken: collections.Counter[str] = collections.Counter()

    def gain(family_id: str) -> int:
        return len(uncovered.intersection(families[family_id]["idioms"]))

    while uncovered:
        open_ = [
            f for f in sorted(families) if f not in chosen and taken[families[f]["category"]] < per_category
        ]
        best = max(open_, key=lambda f: (gain(f), draw[f]), default=None)
        if best is None or gain(best) == 0:
            break  # the cap leaves these idioms uncovered
        chosen.append(best)
        taken[families[best]["category"]] += 1
        uncovered.difference_update(families[best]["idioms"])
    for category in sorted({f["category"] for f in families.values()}):
        rest = sorted(
            (f for f in families if families[f]["category"] == category and f not in chosen), key=draw.get
        )
        chosen.extend(rest[: max(0, per_category - taken[category])])
    return chosen


def write_subset(suite: str | Path, manifest: Mapping, out: str | Path, family_ids: Sequence[str]) -> dict:
    """Copy the tasks of `family_ids` (all splits they occur in) from the suite at `suite` (whose
    manifest is `manifest`) to `out` (new or empty), laid out as the suite is (`out/<split>/<task>`)
    with a manifest of the same form restricted to them (`subset_of`: the source and the
    families); returns that manifest."""
    suite, out = Path(suite), Path(out)
    known = {f["family_id"] for f in manifest["families"]}
    unknown = sorted(set(family_ids) - known)
    if unknown:
        raise ValueError(f"{suite} has no family {', '.join(unknown)}")
    _check_new_directory(out)
    wanted = set(family_ids)
    tasks = [t for t in manifest["tasks"] if t["family"] in wanted]
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for task in tasks:
        shutil.copytree(suite / task["path"], staging / task["path"], symlinks=True)
    subset = {
        **manifest,
        "subset_of": {"suite": str(suite.resolve()), "families": list(family_ids)},
        "families": [f for f in manifest["families"] if f["family_id"] in wanted],
        "tasks": tasks,
    }
    (staging / "manifest.json").write_text(json.dumps(subset, indent=1) + "\n")
    _move_into_place(staging, out)
    return subset
