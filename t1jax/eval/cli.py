"""`t1jax eval`: evaluate a checkpoint (or the oracle / no-op agent) on any Terminal-Bench 1.x or
Harbor task directory, in Harbor's job layout, resumably (`t1jax.eval.job`).

    t1jax eval --tasks DIR --agent oracle                   # prove the environments and verifiers first
    t1jax eval --tasks DIR --agent nop                      # ... and that doing nothing earns nothing
    t1jax eval --tasks DIR --checkpoint PATH [--attempts 3] [--concurrency 8] [--out JOB_DIR]
    t1jax eval --rescore JOB_DIR [--out NEW_JOB_DIR]        # its trials' replies replayed, verified anew

Decoding defaults are the paper's evaluation protocol (§6.1): temperature 0.1, top-p 0.95,
top-k 20, 3 attempts, 60 turns; `--greedy` decodes with temperature 0. Re-running the same
command after an interruption continues the job (the default `--out` is derived from the
arguments, so it is the same directory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tasks", type=Path, default=None, help="a Terminal-Bench 1.x or Harbor task directory"
    )
    parser.add_argument(
        "--rescore", type=Path, default=None, metavar="JOB_DIR",
        help="score a finished job again without its agent: each trial's recorded replies replayed "
        "into a fresh sandbox, then the task's verifier (t1jax.eval.rescore); writes JOB_DIR-rescored",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint", default=None, help="HF directory, or a t1jax run dir / weights checkpoint"
    )
    parser.add_argument("--agent", choices=("model", "oracle", "nop"), default="model")
    parser.add_argument("--attempts", type=int, default=3, help="trials per task (pass@k up to this k)")
    parser.add_argument(
        "--task-sample", type=int, default=None, metavar="N",
        help="evaluate only N of the tasks, spread evenly over them in task-id order",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=8, help="trials at once (sampler slots too)")
    parser.add_argument("--out", type=Path, default=None, help="job directory (default: jobs/eval-<digest>)")
    decoding = parser.add_argument_group("decoding (paper §6.1 defaults)")
    decoding.add_argument("--greedy", action="store_true", help="temperature 0 (overrides the three below)")
    decoding.add_argument("--temperature", type=float, default=0.1)
    decoding.add_argument("--top-p", type=float, default=0.95)
    decoding.add_argument("--top-k", type=int, default=20)
    decoding.add_argument("--seed", type=int, default=0)
    harness = parser.add_argument_group(
        "harness (defaults: the paper's evaluation harness, or the --harness file's; a flag overrides both)"
    )
    harness.add_argument(
        "--harness", type=Path, default=None, metavar="CONFIG",
        help="a t1jax train / t1jax sft config (YAML) whose harness section is the one the policy "
             "was trained in: evaluate under the same prompt, limits and command deadlines",
    )  # fmt: skip
    harness.add_argument("--max-turns", type=int, default=None, help="default 60")
    harness.add_argument(
        "--context-window",
        type=int,
        default=None,
        help="tokens (capped by the model's positions); default 96000",
    )
    harness.add_argument("--max-tokens-per-turn", type=int, default=None, help="default 8192")
    harness.add_argument("--agent-timeout", type=float, default=None, help="seconds (default: each task's)")
    harness.add_argument("--terminal", choices=("tmux", "exec"), default=None, help="default tmux")
    harness.add_argument(
        "--prompt-profile", default=None,
        help="system prompt and completion protocol: full (default) | compact | compact-once "
        "(t1jax.agent.prompts.PROMPT_PROFILES; the one the model learnt)",
    )  # fmt: skip
    harness.add_argument(
        "--budget-note", action="store_true", default=None,
        help="end the instruction and every observation with the agent time and turns left "
        "(HarnessConfig.budget_note; off by default: the prompts the policy was trained on)",
    )  # fmt: skip
    model = parser.add_argument_group("model")
    model.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)"
    )
    model.add_argument(
        "--devices", type=int, default=None, help="sampler devices (default: 1 on CPU, else all)"
    )
    sandboxes = parser.add_argument_group("sandboxes")
    sandboxes.add_argument(
        "--url", default=None, help="a running sandbox service (else an in-process backend)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no live display (logs and CI)")
    from sandbox_service.providers import add_backend_flags

    add_backend_flags(parser)


def default_job_dir(settings_json: dict) -> Path:
    digest = hashlib.sha256(json.dumps(settings_json, sort_keys=True).encode()).hexdigest()[:12]
    return Path("jobs") / f"eval-{digest}"


def run(args: argparse.Namespace) -> int:
    from sandbox_service.cli_contract import UsageError, checking_input

    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.rescore is not None:
        return rescore(args)
    if args.tasks is None:
        raise UsageError("--tasks DIR is needed (or --rescore JOB_DIR)")
    if args.task_sample is not None and args.task_sample < 1:
        raise UsageError(f"--task-sample must be >= 1, got {args.task_sample}")
    if not args.tasks.is_dir():
        raise UsageError(f"--tasks {args.tasks} is not a directory")
    if args.agent == "model" and not args.checkpoint:
        raise UsageError("--agent model (the default) needs --checkpoint; or use --agent oracle / nop")
    if args.agent == "model":
        from t1jax.checkpoints import parse_dtype, resolve_checkpoint

        with checking_input():
            resolve_checkpoint(args.checkpoint)
            parse_dtype(args.dtype)
    with checking_input():
        settings = _settings(args)
    try:  # the harness's own checks, now rather than at the first trial
        eval_harness(settings, settings.context_window, scripted=True)
    except (TypeError, ValueError) as error:
        where = f"--harness {args.harness}: " if args.harness is not None else ""
        raise UsageError(f"{where}{error}") from None
    return evaluate(settings, args)


def _settings(args: argparse.Namespace):
    from t1jax.eval.job import EvalSettings

    return EvalSettings(
        tasks_dir=str(args.tasks.resolve()),
        agent=args.agent,
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        attempts=args.attempts,
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        task_sample=args.task_sample,
        **harness_settings(args),
    )


# `HarnessConfig` fields an evaluation takes from a --harness file (the EvalSettings fields of the
# same names); a run config's `sampler_timeout_sec` is how long a hung sampler is waited for, which
# decides no result, so it is accepted and not used.
HARNESS_FIELDS = ("max_turns", "max_tokens_per_turn", "context_window", "min_turn_tokens",
                  "observation_reserve_tokens", "compaction", "summary_max_tokens", "max_compactions",
                  "max_output_bytes", "default_command_duration_sec", "max_command_duration_sec",
                  "agent_timeout_sec", "terminal", "prompt_profile", "budget_note",
                  "budget_note_format")  # fmt: skip
_FLAGS = {"max_turns": "max_turns", "max_tokens_per_turn": "max_tokens_per_turn",
          "context_window": "context_window", "agent_timeout_sec": "agent_timeout",
          "terminal": "terminal", "prompt_profile": "prompt_profile",
          "budget_note": "budget_note"}  # fmt: skip


def harness_settings(args: argparse.Namespace) -> dict:
    """The evaluation's harness fields: the --harness file's `harness:` section, each flag given
    on the command line over it, EvalSettings' defaults (the paper's harness) for the rest.
    A file that cannot be read, or has no harness section, is a UsageError naming it."""
    fields: dict = {}
    if args.harness is not None:
        fields = read_harness_file(args.harness)
    for name, flag in _FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            fields[name] = value
    return fields


def read_harness_file(path: Path) -> dict:
    import yaml

    from sandbox_service.cli_contract import UsageError

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UsageError(
            f"--harness {path}: cannot read it ({type(error).__name__}: {error})".splitlines()[0]
        ) from None
    section = data.get("harness") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise UsageError(f"--harness {path}: no harness section (a t1jax train or t1jax sft config has one)")
    unknown = sorted(set(section) - set(HARNESS_FIELDS) - {"sampler_timeout_sec"})
    if unknown:
        raise UsageError(f"--harness {path}: harness.{unknown[0]} is not a harness setting")
    return {name: value for name, value in section.items() if name in HARNESS_FIELDS}


def rescore(args: argparse.Namespace) -> int:
    """`--rescore JOB_DIR`: the job's settings with the replay agent, into JOB_DIR-rescored."""
    import dataclasses

    from sandbox_service.cli_contract import UsageError
    from t1jax.eval.job import EvalSettings
    from t1jax.eval.rescore import source_settings

    source = args.rescore
    try:
        fields = source_settings(source)
        known = {f.name for f in dataclasses.fields(EvalSettings)}
        old = EvalSettings(**{k: v for k, v in fields.items() if k in known})
        settings = dataclasses.replace(old, agent="replay", rescore_of=str(source.resolve()))
    except (TypeError, ValueError) as error:
        raise UsageError(str(error).splitlines()[0]) from None
    if not Path(settings.tasks_dir).is_dir():
        raise UsageError(f"--rescore {source}: its task directory {settings.tasks_dir} is gone")
    if args.out is None:
        args.out = source.parent / f"{source.name}-rescored"
    return evaluate(settings, args)


def evaluate(settings, args: argparse.Namespace) -> int:
    """Build the agent, the sandboxes and the scheduler, run the job, print the table."""
    from sandbox_service.cli_contract import UsageError, checking_input
    from sandbox_service.signals import StopOnSignal
    from sandbox_service.tasks import load_dataset

    with checking_input():
        dataset = load_dataset(settings.tasks_dir)
    if not dataset.tasks and not dataset.errors:
        raise UsageError(f"no tasks found under {settings.tasks_dir}")
    # While the trials run, SIGINT / SIGTERM stop the job at its next poll: its running trials
    # cancelled and their sandboxes reclaimed (a second signal stops waiting for that), the
    # finished trials kept. Before (loading the model, building the environments) a Ctrl-C
    # interrupts at once, as it always did.
    stop = StopOnSignal()
    try:
        return _evaluate(settings, args, dataset, stop)
    except KeyboardInterrupt:
        if not stop.signum:
            raise
        print(
            f"t1jax eval: stopped by signal {stop.signum}: running trials cancelled, finished ones "
            "kept (the same command continues the job)",
            file=sys.stderr,
        )
        return 128 + stop.signum


def _evaluate(settings, args: argparse.Namespace, dataset, stop) -> int:
    import dataclasses

    from t1jax.eval.job import EvalJob, sample_tasks
    from t1jax.runtime.scheduler import TrialScheduler

    agent = build_agent(settings, args)
    with agent:
        settings = dataclasses.replace(settings, context_window=agent.context_window)
        job_dir = args.out or default_job_dir(settings.to_json())
        job = EvalJob(job_dir, settings, sample_tasks(dataset.tasks, settings.task_sample), dataset.errors)
        if agent.replay is not None:
            from t1jax.eval.rescore import plan_rescore

            trial_ids = [spec.trial_id for spec in job.specs]
            replay, job.not_runnable = plan_rescore(Path(settings.rescore_of), trial_ids)
            agent.replay.records = replay.records
            job.annotate = agent.replay.annotation
        for spec in job.specs:
            agent.register(spec)
        run_id = "eval-" + hashlib.sha256(str(Path(job_dir).resolve()).encode()).hexdigest()[:12]
        with sandbox_provider(args, run_id) as sandboxes:
            job.audit_environments(sandboxes)
            scheduler = TrialScheduler(
                sampler=agent.sampler,
                sandboxes=sandboxes,
                tokenizer=agent.tokenizer,
                harness=agent.harness(settings),
                reward=_reward_config(settings),
                run_id=run_id,
                concurrency=args.concurrency,
                assemble=False,
            )
            with stop, scheduler:  # the scheduler's clean-up, too, under the flag handler
                result = _run_with_display(
                    job, scheduler, agent.tokenizer.decode, quiet=args.no_progress, stop=stop.event
                )
    print_table(result, job_dir)
    return 0


def _reward_config(settings):
    from t1jax.rl.reward import RewardConfig

    return RewardConfig(scale=settings.reward_scale)


# ---- the agent: a model behind the JAX engine, or a scripted policy -----------------------------


class Agent:
    """The sampler, tokenizer and harness limits for one evaluation; a context manager that
    closes the engine."""

    def __init__(self, sampler, tokenizer, context_window: int, *, scripted: bool, book=None, closer=None):
        self.sampler, self.tokenizer, self.context_window = sampler, tokenizer, context_window
        self.scripted, self._book, self._closer = scripted, book, closer
        self.replay = None  # the replay agent's state (t1jax.eval.rescore.Replay)

    def register(self, spec) -> None:
        if self._book is not None:
            self._book.register(spec.trial_id, spec.task)

    def harness(self, settings):
        return eval_harness(settings, self.context_window, scripted=self.scripted)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc) -> None:
        if self._closer is not None:
            self._closer()


def eval_harness(settings, context_window: int, *, scripted: bool):
    """The trials' `HarnessConfig`: the settings' harness fields, with the ones left None derived
    from `context_window` (the settings' own, capped by the model's positions)."""
    from t1jax.agent.harness import HarnessConfig

    max_tokens = min(settings.max_tokens_per_turn, context_window // 2)

    def given(value, derived):
        return derived if value is None else value

    note_format = {}
    if settings.budget_note_format is not None:
        note_format["budget_note_format"] = settings.budget_note_format
    return HarnessConfig(
        max_turns=settings.max_turns,
        max_tokens_per_turn=max_tokens,
        min_turn_tokens=min(given(settings.min_turn_tokens, 256), max_tokens),
        observation_reserve_tokens=settings.observation_reserve_tokens,
        context_window=context_window,
        summary_max_tokens=given(settings.summary_max_tokens, min(2048, max(64, context_window // 8))),
        compaction=given(settings.compaction, context_window >= 8192),
        max_compactions=settings.max_compactions,
        max_output_bytes=settings.max_output_bytes,
        default_command_duration_sec=settings.default_command_duration_sec,
        max_command_duration_sec=settings.max_command_duration_sec,
        agent_timeout_sec=settings.agent_timeout_sec,
        terminal=settings.terminal,
        prompt_profile=settings.prompt_profile,
        require_routing=not scripted,
        budget_note=settings.budget_note,
        **note_format,
    )


def build_agent(settings, args) -> Agent:
    if settings.agent == "replay":
        from t1jax.agent.scripted import ScriptedSampler
        from t1jax.agent.tokenizer import load_project_tokenizer
        from t1jax.eval.rescore import Replay

        if settings.checkpoint:  # the ids replayed are that model's tokens: its tokenizer glues them
            from t1jax.checkpoints import load_policy

            _, tokenizer, _ = load_policy(settings.checkpoint, settings.dtype)
        else:
            tokenizer = load_project_tokenizer()
        replay = Replay({})
        agent = Agent(ScriptedSampler(tokenizer, replay.policy, with_routing=False), tokenizer,
                      settings.context_window, scripted=True)  # fmt: skip
        agent.replay = replay
        return agent
    if settings.agent in ("oracle", "nop"):
        from t1jax.agent.scripted import ScriptedSampler
        from t1jax.agent.tokenizer import load_project_tokenizer
        from t1jax.eval.agents import TaskBook, nop_policy, oracle_policy

        tokenizer = load_project_tokenizer()
        book = TaskBook()
        policy = oracle_policy(book) if settings.agent == "oracle" else nop_policy()
        sampler = ScriptedSampler(tokenizer, policy, with_routing=False)
        return Agent(sampler, tokenizer, settings.context_window, scripted=True, book=book)
    import jax

    from t1jax.checkpoints import load_policy
    from t1jax.rollout.engine import EngineConfig, JaxEngine

    model, tokenizer, _ = load_policy(settings.checkpoint, settings.dtype)
    context = min(settings.context_window, model.config.max_position_embeddings)
    devices = jax.devices()
    count = args.devices or (1 if devices[0].platform == "cpu" else len(devices))
    engine = JaxEngine(model, devices[:count], EngineConfig(max_batch=args.concurrency, max_context=context))
    return Agent(engine, tokenizer, context, scripted=False, closer=engine.close)


class sandbox_provider:
    """The sandboxes of one evaluation: a running service (`--url`) or admission control over an
    in-process backend. On entry, whatever an earlier, killed run of this job left is reaped; on
    exit, every sandbox of the run is reclaimed."""

    def __init__(self, args, run_id: str):
        self.args, self.run_id = args, run_id
        self.backend = self.controller = None

    def __enter__(self):
        if self.args.url:
            from sandbox_service.client import SandboxServiceClient

            self.controller = SandboxServiceClient(self.args.url)
        else:
            from sandbox_service import ProviderSettings, open_provider
            from sandbox_service.admission import AdmissionConfig, AdmissionController

            self.backend = open_provider(ProviderSettings.from_args(self.args))
            config = AdmissionConfig(max_live_sandboxes=self.args.concurrency, create_rate_per_sec=None)
            self.controller = AdmissionController(self.backend, config)
        self.controller.leak_check(self.run_id)  # a killed run of this job left these behind
        return self.controller

    def __exit__(self, *exc) -> None:
        try:
            self.controller.leak_check(self.run_id)
        finally:
            if self.backend is not None:
                self.controller.shutdown()
                close = getattr(self.backend, "close", None)
                if close is not None:
                    close()
            else:
                self.controller.close()


# ---- display -------------------------------------------------------------------------------------


def _run_with_display(job, scheduler, decode, *, quiet: bool, stop=None):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    todo, done = job.prepare()
    counts = {"errors": sum(r["error"] is not None for r in done.values()), "resolved": 0}
    counts["resolved"] = sum(bool(r["resolved"]) for r in done.values())
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]eval[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
    )

    def status(running: int) -> str:
        return f"running {running}  errors {counts['errors']}  resolved {counts['resolved']}"

    with progress:
        bar = progress.add_task("eval", total=len(job.specs), completed=len(done), status=status(0))

        def on_trial(result, finished, total):
            counts["errors"] += result["error"] is not None
            counts["resolved"] += bool(result["resolved"])
            progress.update(bar, completed=finished)

        def on_poll(running):
            progress.update(bar, status=status(running))

        return job.run(scheduler, decode, on_trial=on_trial, on_poll=on_poll, stop=stop)


def print_table(result: dict, job_dir) -> None:
    from rich.console import Console
    from rich.table import Table

    ks = sorted(result["pass_at_k"], key=int)
    table = Table(title=f"t1jax eval: {job_dir}")
    columns = ("group", "trials", "errors", "resolved", "mean reward", *(f"pass@{k}" for k in ks), "turns")
    for column in columns:
        table.add_column(column, justify="left" if column == "group" else "right", no_wrap=True)

    def row(name, summary):
        def pct(value):
            return "-" if value is None else f"{100 * value:.1f}%"

        table.add_row(
            name,
            str(summary["n_trials"] if "n_trials" in summary else result["n_total_trials"]),
            str(summary["n_errors"]),
            pct(summary["resolved_rate"]),
            "-" if summary["mean_reward"] is None else f"{summary['mean_reward']:.3f}",
            *(pct(summary["pass_at_k"].get(k)) for k in ks),
            "-" if summary["mean_action_turns"] is None else f"{summary['mean_action_turns']:.2f}",
        )

    row("all", result)
    for name, summary in result["by_category"].items():
        row(f"category {name}", summary)
    for name, summary in result["by_difficulty"].items():
        row(f"difficulty {name}", summary)
    console = Console(width=max(100, Console().width))
    console.print(table)
    if result.get("resolved_rate_ci95"):
        low, high = result["resolved_rate_ci95"]
        console.print(
            f"resolved {100 * result['resolved_rate']:.1f}%, 95% bootstrap interval "
            f"[{100 * low:.1f}%, {100 * high:.1f}%] resampling {result['ci95_resampled']}"
        )
    if result["errors"]:
        console.print(
            f"{len(result['errors'])} errored trials (reward 0), e.g. {result['errors'][0]['cause']}: "
            f"{result['errors'][0]['detail'][:160]}"
        )
    for skipped in result["skipped"]:
        console.print(f"skipped {skipped['task_id']}: {skipped['reason'][:200]}")
    backends = ", ".join(result.get("backends", [])) or "-"
    unfaithful = result.get("unfaithful", [])
    console.print(
        f"ran on {backends}; "
        + (
            f"{len(unfaithful)} task(s) on a stand-in image, e.g. {unfaithful[0]['environment'][:200]}"
            if unfaithful
            else "every task on its own image"
        )
    )
