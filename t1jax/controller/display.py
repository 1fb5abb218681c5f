"""The live display of `t1jax train` (rich): step, trials launched / finished / admitted /
cancelled, reward (raw and EMA with alpha = 0.25, as the paper's figures), and the step's time
split. Off when stderr is not a terminal or `logging.display` is false; the same numbers are
in metrics.jsonl either way."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EMA_ALPHA = 0.25


@dataclass
class Ema:
    alpha: float = EMA_ALPHA
    value: float | None = None

    def update(self, x: float) -> float | None:
        if x is None or not math.isfinite(x):
            return self.value
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        return self.value


@dataclass
class DisplayState:
    run: str
    steps: int
    step: int = 0
    phase: str = "starting"
    launched: int = 0
    finished: int = 0
    admitted: int = 0
    cancelled: int = 0
    failed: int = 0
    reward: float | None = None
    reward_ema: Ema = field(default_factory=Ema)
    times: dict[str, float] = field(default_factory=dict)
    note: str = ""


class Display:
    def __init__(self, state: DisplayState, *, enabled: bool):
        self.state = state
        self._live = None
        if enabled:
            import sys

            from rich.console import Console
            from rich.live import Live

            console = Console(stderr=True)
            if console.is_terminal and sys.stderr.isatty():
                self._live = Live(self._render(), console=console, refresh_per_second=2, transient=False)

    def __enter__(self) -> Display:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)

    def refresh(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self.state, key, value)
        if self._live is not None:
            self._live.update(self._render())

    def _render(self):
        from rich.table import Table

        s = self.state
        table = Table(title=f"t1jax train: {s.run}", show_header=False, expand=False)
        table.add_column(justify="left")
        table.add_column(justify="right")
        table.add_row("step", f"{s.step} / {s.steps}   ({s.phase})")
        table.add_row(
            "trials",
            f"launched {s.launched}  finished {s.finished}  admitted {s.admitted}  "
            f"cancelled {s.cancelled}  failed {s.failed}",
        )
        reward = "-" if s.reward is None else f"{s.reward:.3f}"
        ema = "-" if s.reward_ema.value is None else f"{s.reward_ema.value:.3f}"
        table.add_row("reward", f"{reward}   (EMA {ema})")
        if s.times:
            table.add_row("time (s)", "  ".join(f"{k} {v:.1f}" for k, v in s.times.items()))
        if s.note:
            table.add_row("", s.note)
        return table
