"""`t1jax train`: run (or resume) an RL run from a run config (`t1jax.controller.loop`).

    t1jax train --config configs/runs/tiny_cpu.yaml [--run-dir runs/NAME] [--set run.steps=3 ...]
    t1jax train --resume runs/NAME [--set run.steps=16]

The resolved config (every default filled in) is written to RUN/config.yaml; `--resume` runs
exactly it from the last state checkpoint. On resume `--set` may change only what does not change
what the run trains (`RESUME_OVERRIDABLE`: its length, its display, its liveness deadlines), so
`--resume RUN --set run.steps=16` extends a finished 8-step run; the change is written back to
RUN/config.yaml (a later resume keeps it) and logged. Bad config, or a device split this host
cannot give: one line naming it, exit 2, before the run directory is made or any device work.
Interrupted (SIGINT/SIGTERM): trials cancelled, sandboxes closed, a checkpoint written, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

log = logging.getLogger("t1jax.train")

# Keys `--resume --set` may change: none alters what a step computes, so the steps already taken
# and the ones to come belong to the same run (a learning rate or a reward changed mid-run would
# make a different run under the old one's name).
RESUME_OVERRIDABLE = ("run.steps", "logging.display", "logging.tensorboard", "liveness")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="a run config (configs/runs/*.yaml)")
    source.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue the run in RUN_DIR")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: runs/<run.name>-<time>")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key (YAML value), e.g. --set run.steps=3; repeatable; a relative "
             "path is read relative to the config file's directory, as in the file",
    )  # fmt: skip
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def parse_overrides(pairs: list[str], *, flag: str = "--set") -> dict:
    """`KEY=VALUE` command-line overrides -> {KEY: value}, each value read as YAML
    (`t1jax.yamlio`); `flag` names the option in the one-line refusal of a malformed pair."""
    from sandbox_service.cli_contract import UsageError
    from t1jax.yamlio import load_yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag}: {pair!r} is not KEY=VALUE")
        out[key.strip()] = load_yaml(value)
    return out


def run(args: argparse.Namespace) -> int:
    from sandbox_service.cli_contract import checking_input

    with checking_input():
        overrides = parse_overrides(args.set)
        config, run_dir, base_dir, resume = _open_run(args, overrides)
    _configure_logging(run_dir, args.log_level)
    if resume and overrides:
        log.info("resumed with %s", ", ".join(f"{k}={v!r}" for k, v in overrides.items()))
    return train(config, run_dir, resume=resume, base_dir=base_dir)


def _open_run(args: argparse.Namespace, overrides: dict):
    """The run's config and directory: the resumed one's, or a new one, made only once the config
    and the devices it asks for have been checked (a refused run leaves nothing behind)."""
    from sandbox_service.cli_contract import UsageError
    from t1jax.controller.config import (
        apply_overrides,
        load_run_config,
        override_within,
        run_config_from_dict,
    )
    from t1jax.controller.rundir import RunDir

    if args.resume is not None:
        for key in overrides:
            if not override_within(key, RESUME_OVERRIDABLE):
                raise UsageError(
                    f"--set {key}: a resumed run keeps its own config.yaml; on resume only "
                    f"{', '.join(RESUME_OVERRIDABLE)} may change (start a new run to change anything else)"
                )
        run_dir = RunDir(args.resume)
        raw = apply_overrides(run_dir.config(), overrides)
        config = run_config_from_dict(raw, source=str(run_dir.path / "config.yaml"))
        base_dir = run_dir.path
        config.check(base_dir=base_dir)
        check_devices(config)
        if overrides:
            run_dir.replace_config(config.resolved())
        resume = True
    else:
        config = load_run_config(args.config, overrides=overrides)
        base_dir = args.config.resolve().parent
        config = config.with_absolute_paths(base_dir)
        path = args.run_dir or Path("runs") / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = RunDir(path)
        resolved = config.resolved()
        check_devices(config)
        run_dir.create(resolved)
        resume = False
    return config, run_dir, base_dir, resume


def train(config, run_dir, *, resume: bool, base_dir: Path) -> int:
    """Check the split against the visible devices, then run the controller (the test suite and
    notebooks call this directly)."""
    from t1jax.controller.loop import Controller

    check_devices(config)
    return Controller(config, run_dir, resume=resume, base_dir=base_dir).run()


def check_devices(config) -> None:
    """Refuse a trainer / sampler split the visible devices cannot give (a `ConfigError`). On a
    CPU host ask XLA for that many devices first (one otherwise; an accelerator ignores it).
    Under Pathways the devices are the backend's, seen only once it is initialised."""
    from t1jax.host_devices import request_host_devices

    if config.run.pathways:
        return
    request_host_devices(config.devices.trainer + config.devices.sampler)
    import jax

    config.check_devices(len(jax.devices()))


def _configure_logging(run_dir, level: str) -> None:
    handler = logging.FileHandler(run_dir.path / "run.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    console.setLevel(logging.WARNING)  # the live display shows progress; the log file has the rest
    root.addHandler(console)
    for noisy in ("absl", "orbax", "jax._src", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, getattr(logging, level.upper())))
