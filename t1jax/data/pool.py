"""The task pool of a training run: a grain data source over a task directory, shuffled per epoch.

The paper's pool is materialised in quality order, so a sequential cursor would sweep from best
to worst and drift the reward the critic sees (§2.1, §5.4); every epoch is therefore a fresh
seeded permutation (grain's `MapDataset.shuffle` before `repeat`, which reseeds each epoch).

A `TaskPool` is an endless, deterministic sequence: draw `k` is `dataset[k]`, a pure function of
(the task directory's sorted task ids, the seed, k). Its whole iterator state is the cursor `k`
(`state()` / `restore(state)`), which checkpoints as one integer next to the learner: a resumed
run draws exactly the tasks an uninterrupted one would, none skipped, none twice within an
epoch.

Invariants:
- Within an epoch (draws [e * n, (e + 1) * n)) every task appears exactly once.
- `draw(count)` returns `PoolDraw`s carrying their global index and epoch, so a caller can
  re-launch exactly the draws it lost (e.g. an in-flight rollout at a crash) by index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grain

from sandbox_service.contracts import Task
from sandbox_service.tasks import load_dataset


class TaskSource:
    """A grain random-access data source over tasks, in task-id order (so the order does not
    depend on how the directory happens to be walked)."""

    def __init__(self, tasks: Sequence[Task]):
        self._tasks = tuple(sorted(tasks, key=lambda task: task.task_id))
        if not self._tasks:
            raise ValueError("the task pool is empty")

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, index: int) -> Task:
        return self._tasks[index]


@dataclass(frozen=True)
class PoolDraw:
    index: int  # global draw index: epoch * len(pool) + position
    epoch: int
    task: Task


class TaskPool:
    def __init__(self, tasks: Sequence[Task], *, seed: int):
        self.source = TaskSource(tasks)
        self.seed = int(seed)
        self._dataset = grain.MapDataset.source(self.source).shuffle(seed=self.seed).repeat(None)
        self._cursor = 0

    @classmethod
    def from_directory(cls, directory: str | Path, *, seed: int) -> tuple[TaskPool, tuple]:
        """(pool, load errors): malformed tasks are left out and reported, never drawn."""
        dataset = load_dataset(directory)
        if not dataset.tasks:
            first = f": {dataset.errors[0]}" if dataset.errors else ""
            raise ValueError(f"no loadable task under {directory}{first}")
        return cls(dataset.tasks, seed=seed), dataset.errors

    def __len__(self) -> int:
        return len(self.source)

    def at(self, index: int) -> PoolDraw:
        return PoolDraw(index, index // len(self.source), self._dataset[index])

    def draw(self, count: int) -> list[PoolDraw]:
        draws = [self.at(self._cursor + i) for i in range(count)]
        self._cursor += count
        return draws

    @property
    def cursor(self) -> int:
        return self._cursor

    @property
    def epoch(self) -> int:
        return self._cursor // len(self.source)

    def state(self) -> dict[str, int]:
        return {"cursor": self._cursor, "seed": self.seed, "size": len(self.source)}

    def restore(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed or state["size"] != len(self.source):
            raise ValueError(
                f"the checkpointed task pool (seed {state['seed']}, {state['size']} tasks) is not this "
                f"one (seed {self.seed}, {len(self.source)} tasks): the task directory changed"
            )
        self._cursor = int(state["cursor"])
