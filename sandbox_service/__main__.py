"""Command line of the sandbox service: `python -m sandbox_service {serve,check-tasks,reap,...}`.

This module owns turning flags into a backend, an admission policy and a running server; it holds
no logic of its own beyond that wiring.

    serve        run the HTTP service (until SIGINT/SIGTERM, which closes every sandbox)
    check-tasks  run each task's reference solution and verifier; say per task which backend ran
                 it on what image, and which tasks are unsound or skipped, and why (SIGINT or
                 SIGTERM: its trials cancelled, its sandboxes reaped, exit 128 + the signal)
    reap         kill every sandbox a backend still has for a run (after a crash)
    leak-check   ask a running service to reclaim and report what a run left behind
    stand-ins    build (or list) the stand-in base images for images no registry serves here

Errors follow `sandbox_service.cli_contract`: bad input (a missing directory, an unknown flag
value, a missing verifier toolchain) is one line naming it on stderr and exit status 2; any other
failure (a backend that cannot start included) one line and exit status 1; `--debug` shows the
traceback too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from sandbox_service.admission import AdmissionConfig, AdmissionController
from sandbox_service.cli_contract import EXIT_INTERRUPTED, OneLineArgumentParser, UsageError, run_command
from sandbox_service.contracts import SandboxProvider, TaskLimits
from sandbox_service.providers import (
    DEFAULT_CACHE_DIR,
    ProviderSettings,
    add_backend_flags,
    open_provider,
    require_toolchain,
)
from sandbox_service.signals import StopOnSignal


def _rate(text: str) -> float | None:
    if text.lower() in ("off", "none", "0"):
        return None
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("the creation rate must be positive, or 'off'")
    return value


def open_backend(args: argparse.Namespace, *, toolchain: bool = False) -> SandboxProvider:
    """The backend the flags name (`sandbox_service.open_provider`); with `toolchain`, first
    refuse (bad input) a missing verifier toolchain, before any work."""
    settings = ProviderSettings.from_args(args)
    if toolchain:
        from sandbox_service.verifier import ToolchainMissing

        try:
            require_toolchain(settings)
        except ToolchainMissing as error:
            raise UsageError(str(error)) from None
    return open_provider(settings)


def admission_config(args: argparse.Namespace) -> AdmissionConfig:
    return AdmissionConfig(
        create_rate_per_sec=args.rate,
        create_burst=args.burst,
        max_live_sandboxes=args.max_live,
        deadline_caps=TaskLimits(
            agent_timeout_sec=args.agent_timeout,
            verifier_timeout_sec=args.verifier_timeout,
            total_timeout_sec=args.total_timeout,
        ),
        admission_timeout_sec=args.admission_timeout,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from sandbox_service.access import AccessPolicy, AccessRefused, check_bind, load_token
    from sandbox_service.server import TaskStore, create_app, serve

    try:  # before anything starts: a service open to others is refused outright
        token = load_token(token_file=args.token_file, token_env=args.token_env)
        check_bind(args.host, token)
    except AccessRefused as error:
        raise UsageError(str(error)) from None
    backend = open_backend(args)
    controller = AdmissionController(backend, admission_config(args))
    store_dir = args.task_store or Path(tempfile.mkdtemp(prefix="t1jax-task-store-"))
    close_backend = getattr(backend, "close", None)
    app = create_app(
        controller, TaskStore(store_dir), backend_name=args.backend, on_shutdown=close_backend,
        access=AccessPolicy(token),
    )  # fmt: skip
    # SIGINT/SIGTERM: uvicorn stops accepting requests, the app's shutdown closes every trial and the
    # backend, then uvicorn re-raises the signal (so the exit status says which signal ended it).
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def cmd_check_tasks(args: argparse.Namespace) -> int:
    from sandbox_service.check_tasks import all_sound, check_tasks
    from sandbox_service.tasks import find_task_dirs

    if not args.tasks_dir.is_dir():
        raise UsageError(f"task directory not found: {args.tasks_dir}")
    if args.task_timeout is not None and args.task_timeout <= 0:
        raise UsageError(f"--task-timeout must be positive, got {args.task_timeout:g}")
    if not find_task_dirs(args.tasks_dir):
        raise UsageError(
            f"no tasks under {args.tasks_dir} (a task directory holds task.toml, instruction.md, "
            "task.yaml or run-tests.sh; symlinked directories are not followed)"
        )
    backend = None
    if args.url:
        from sandbox_service.client import SandboxServiceClient

        provider: SandboxProvider = SandboxServiceClient(args.url)
        name = f"service at {args.url}"
    else:
        backend = open_backend(args, toolchain=True)
        provider = AdmissionController(backend, AdmissionConfig(create_rate_per_sec=None))
        name = args.backend
    run_id = args.run_id or f"check-tasks-{os.getpid()}"
    audits = []
    interrupted = False
    # Through the clean-up too: a first SIGTERM there must not cut the reaping short.
    with StopOnSignal() as stop:
        try:
            audits = check_tasks(
                args.tasks_dir,
                provider,
                run_id=run_id,
                max_workers=args.workers,
                on_audit=lambda audit: print(audit.line(), flush=True),
                task_timeout_sec=args.task_timeout,
                backend_name=name,
                stop=stop.event,
            )
        except KeyboardInterrupt:
            interrupted = True
            message = "interrupted: cancelling the run's trials and reaping its sandboxes"
            print(message, file=sys.stderr, flush=True)
        finally:
            if isinstance(provider, AdmissionController):
                provider.shutdown()
            else:
                provider.close()  # type: ignore[attr-defined]
            if backend is not None:
                reap = getattr(backend, "reap", None)
                if reap is not None:
                    reap(run_id)
                close_backend = getattr(backend, "close", None)
                if close_backend is not None:
                    close_backend()
    if interrupted:
        return 128 + stop.signum if stop.signum else EXIT_INTERRUPTED
    if args.json is not None:
        args.json.write_text(json.dumps([audit.to_json() for audit in audits], indent=1))
    sound = sum(audit.sound for audit in audits)
    skipped = sum(audit.skipped for audit in audits)
    judged = len(audits) - skipped
    print(
        f"{sound}/{judged} tasks sound on {name} (solution passes every assertion, no-op fails one)"
        + (f"; {skipped} skipped" if skipped else ""),
        flush=True,
    )
    return 0 if all_sound(audits) else 1


def cmd_reap(args: argparse.Namespace) -> int:
    backend = open_backend(args)
    try:
        reaped = backend.reap(args.run_id)  # type: ignore[attr-defined]
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    print(json.dumps({"run_id": args.run_id, "reaped": reaped}))
    return 0


def cmd_leak_check(args: argparse.Namespace) -> int:
    from sandbox_service.client import SandboxServiceClient

    with SandboxServiceClient(args.url) as client:
        if args.cancel_open:
            cancelled, report = client.reclaim_run(args.run_id)
        else:
            cancelled, report = [], client.leak_check(args.run_id)
    summary = {
        "run_id": args.run_id,
        "cancelled": cancelled,
        "unclosed_trials": list(report.unclosed_trials),
        "orphaned_sandboxes": list(report.orphaned_sandboxes),
        "remaining": list(report.remaining),
    }
    print(json.dumps(summary))
    return 1 if report.remaining else 0


DEFAULT_STAND_IN_IMAGES = ("python:3.11-slim", "debian:bookworm")


def cmd_stand_ins(args: argparse.Namespace) -> int:
    from sandbox_service.base_images import StandInStore, UnsupportedImage, stand_in_for

    store = StandInStore(args.stand_in_dir)
    backend = None
    failed = 0
    for image in args.images or DEFAULT_STAND_IN_IMAGES:
        try:
            recipe, substitution = stand_in_for(image)
        except UnsupportedImage as error:
            print(f"{image}: unsupported: {error.reason}", flush=True)
            failed += 1
            continue
        if args.list:
            print(substitution.describe(), flush=True)
            continue
        started = time.monotonic()
        built = store.build(recipe, log=lambda text: print(text, flush=True))
        if args.import_into_podman:
            if backend is None:
                settings = ProviderSettings(backend="container", cache_dir=args.cache_dir,
                                            stand_in_dir=args.stand_in_dir, pull="never")  # fmt: skip
                backend = open_provider(settings)
            backend.resolve_base(image)
        print(
            f"{image}: {recipe.image_tag} ready ({built.tarball.name}, {time.monotonic() - started:.0f} s)",
            flush=True,
        )
    if backend is not None:
        backend.close()
    return 1 if failed else 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    root = OneLineArgumentParser(prog="python -m sandbox_service", description=__doc__.split("\n\n")[0])
    root.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    root.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = root.add_subparsers(dest="command", required=True, parser_class=OneLineArgumentParser)

    serve = commands.add_parser("serve", help="run the HTTP service")
    add_backend_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed at start)")
    serve.add_argument("--token-file", type=Path, help="the bearer token every request must carry")
    serve.add_argument("--token-env", metavar="VAR", help="read the bearer token from this variable")
    serve.add_argument(
        "--task-store", type=Path, default=None, help="where uploaded task directories are kept"
    )
    policy = serve.add_argument_group("admission")
    policy.add_argument("--rate", type=_rate, default=6.0, help="sandbox creations per second, or 'off'")
    policy.add_argument("--burst", type=int, default=6)
    policy.add_argument(
        "--max-live", type=int, default=35, help="concurrency cap of live sandboxes on this node"
    )
    policy.add_argument(
        "--agent-timeout", type=float, default=3600.0, help="cap on any task's agent deadline"
    )
    policy.add_argument(
        "--verifier-timeout", type=float, default=900.0, help="cap on any task's verifier deadline"
    )
    policy.add_argument(
        "--total-timeout", type=float, default=5400.0, help="cap on any task's total deadline"
    )
    policy.add_argument(
        "--admission-timeout",
        type=float,
        default=None,
        help="longest a create may wait for a slot and a token (default: no limit)",
    )
    serve.set_defaults(run=cmd_serve)

    check = commands.add_parser("check-tasks", help="run every task's solution and verifier")
    add_backend_flags(check)
    check.add_argument("tasks_dir", type=Path)
    check.add_argument(
        "--url", default=None, help="use a running service instead of a backend in this process"
    )
    check.add_argument("--workers", type=_positive_int, default=2, help="tasks audited at once")
    check.add_argument(
        "--task-timeout",
        type=float,
        default=None,
        help="cap (s) on each trial's agent, verifier and total time",
    )
    check.add_argument(
        "--json", type=Path, default=None, help="also write every audit (with verifier output) here"
    )
    check.add_argument(
        "--run-id", default=None, help="run label of the audit's sandboxes (default: per process)"
    )
    check.set_defaults(run=cmd_check_tasks)

    reap = commands.add_parser("reap", help="kill every sandbox of a run left on a backend")
    add_backend_flags(reap)
    reap.add_argument("--run-id", default=None, help="default: every sandbox this backend manages")
    reap.set_defaults(run=cmd_reap)

    leak = commands.add_parser("leak-check", help="reclaim and report what a run left on a running service")
    leak.add_argument("--url", required=True)
    leak.add_argument("--run-id", required=True)
    leak.add_argument("--cancel-open", action="store_true", help="also cancel the run's open trials first")
    leak.set_defaults(run=cmd_leak_check)

    stand_ins = commands.add_parser("stand-ins", help="build or list stand-in base images")
    stand_ins.add_argument("images", nargs="*", help="image references (default: the default suite's)")
    stand_ins.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    stand_ins.add_argument(
        "--stand-in-dir", type=Path, default=None, help="default: ~/.cache/t1jax/stand-ins"
    )
    stand_ins.add_argument(
        "--list", action="store_true", help="print what stands in for each image; build nothing"
    )
    stand_ins.add_argument(
        "--import",
        dest="import_into_podman",
        action="store_true",
        help="also import them into podman (what the container backend runs)",
    )
    stand_ins.set_defaults(run=cmd_stand_ins)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_command(f"python -m sandbox_service {args.command}", lambda: args.run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
