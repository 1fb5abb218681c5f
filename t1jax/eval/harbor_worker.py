"""The t1jax side of the Harbor agent (`t1jax.harbor.agent.T1jaxAgent`): a process in t1jax's own
environment that holds the policy (a checkpoint behind the JAX engine, or the oracle / no-op
policy of `t1jax eval`) and runs `t1jax eval`'s harness (`t1jax.agent.harness.run_trial`) for every
trial Harbor starts, while the commands run in Harbor's environment, over the agent's pipe.

    python -m t1jax.eval.harbor_worker        # started by T1jaxAgent; speaks JSON lines on stdin/stdout

Protocol (one JSON object per line; the worker's own stdout is moved to stderr first, so nothing a
library prints can corrupt it):
- agent -> worker, once: `{"op": "start", "settings": {EvalSettings fields}, "concurrency": N,
  "devices": D|null}`; worker -> agent: `{"op": "ready", "context_window", "agent_info",
  "harness"}` or `{"op": "fatal", "error"}` (one line: what was wrong), then it exits.
- agent -> worker: `{"op": "trial", "trial", "task_dir", "instruction"}` starts a trial;
  `{"op": "cancel", "trial"}` aborts it (Harbor's agent timeout).
- worker -> agent: `{"op": "exec", "trial", "call", "command", "timeout_sec"}`; the agent answers
  `{"op": "result", "call", "stdout", "stderr", "exit_code", "timed_out", "duration_sec"}` or
  `{"op": "result", "call", "error"}` (the environment raised).
- worker -> agent, once per trial: `{"op": "done", "trial", "atif", "summary"}`.

The terminal of the harness's default `tmux` mode is a tmux session in Harbor's environment,
driven through `exec` exactly as the sandbox backends drive theirs (`sandbox_service.backends.local`:
the same session size, key handling and "new output since the last read" rule), so a trial sees
what it sees under `t1jax eval`. The environment needs tmux (Harbor's Terminus-2 needs it too);
`terminal: exec` runs each command as its own process instead.

Invariants: a trial's prompts, limits, parsing and decoding are `t1jax eval`'s for the same
settings (`t1jax.eval.cli.build_agent` and `eval_harness` build them); one worker serves every
concurrent trial of the agent's settings, so the model loads once and the engine batches them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sandbox_service.contracts import ExecResult, SandboxError, SandboxLifecycleError, TerminalRead


class _Channel:
    """The worker's end of the pipe: thread-safe writes, replies matched to calls."""

    def __init__(self, out) -> None:
        self._out = out
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._calls = 0
        self._pending: dict[int, tuple[threading.Event, dict]] = {}

    def send(self, message: dict) -> None:
        line = json.dumps(message)
        with self._write_lock:
            self._out.write(line + "\n")
            self._out.flush()

    def call(self, message: dict, timeout_sec: float) -> dict:
        with self._lock:
            self._calls += 1
            number = self._calls
            done, box = threading.Event(), {}
            self._pending[number] = (done, box)
        self.send({**message, "call": number})
        if not done.wait(timeout_sec):
            with self._lock:
                self._pending.pop(number, None)
            raise SandboxError(f"the Harbor environment did not answer {message['op']} in {timeout_sec:.0f} s")
        return box

    def answer(self, message: dict) -> None:
        with self._lock:
            entry = self._pending.pop(int(message["call"]), None)
        if entry is not None:
            done, box = entry
            box.update(message)
            done.set()

    def fail_all(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for done, box in pending.values():
            box["error"] = reason
            done.set()


class HarborSandbox:
    """A `sandbox_service.contracts.Sandbox` whose commands run in Harbor's environment (over the
    agent's pipe). The harness only executes and types; verification and closing are Harbor's."""

    _ANSWER_GRACE_SEC = 120.0  # beyond a command's own deadline, for the round trip

    def __init__(self, channel: _Channel, trial_id: str, task) -> None:
        self._channel, self._trial_id, self._task = channel, trial_id, task
        self._terminal_started = False
        self._terminal_seen = ""
        self._terminal_lock = threading.Lock()

    @property
    def sandbox_id(self) -> str:
        return self._trial_id

    @property
    def task(self):
        return self._task

    def exec(self, command: str, timeout_sec: float) -> ExecResult:
        reply = self._channel.call(
            {"op": "exec", "trial": self._trial_id, "command": command, "timeout_sec": float(timeout_sec)},
            float(timeout_sec) + self._ANSWER_GRACE_SEC,
        )
        if "error" in reply:
            raise SandboxError(f"the Harbor environment failed: {reply['error']}")
        return ExecResult(
            stdout=reply.get("stdout") or "", stderr=reply.get("stderr") or "", exit_code=reply.get("exit_code"),
            timed_out=bool(reply.get("timed_out")), duration_sec=float(reply.get("duration_sec") or 0.0),
        )  # fmt: skip

    def send_keys(self, keys: str, wait_sec: float) -> TerminalRead:
        from sandbox_service.backends.local import _tmux_key_commands

        with self._terminal_lock:
            self._ensure_terminal()
            self._tmux(_tmux_key_commands(keys))
            if wait_sec > 0:
                time.sleep(wait_sec)
            return self._read_terminal()

    def _tmux(self, commands: list[list[str]]) -> str:
        # one tmux client, its commands separated by `;` (a server with no session yet would exit
        # between two clients)
        words = [word for index, command in enumerate(commands) for word in ([";"] if index else []) + command]
        line = "tmux " + " ".join(shlex.quote(word) for word in words)
        result = self.exec(line, 30)
        if result.exit_code != 0:
            raise SandboxError(f"tmux failed ({result.exit_code}): {result.stderr.strip()[-300:]}")
        return result.stdout

    def _ensure_terminal(self) -> None:
        from sandbox_service.backends.local import TERMINAL_COLUMNS, TERMINAL_ROWS, TMUX_SESSION

        if self._terminal_started:
            return
        if self.exec("command -v tmux", 30).exit_code != 0:
            raise SandboxError("no tmux in the Harbor environment (install it, or use the agent kwarg terminal=exec)")
        self._tmux(
            [
                ["-f", "/dev/null", "start-server"],
                ["set-option", "-g", "history-limit", "100000"],
                ["new-session", "-d", "-s", TMUX_SESSION, "-x", str(TERMINAL_COLUMNS), "-y", str(TERMINAL_ROWS),
                 "-c", self._task.environment.workdir, "/bin/bash"],
            ]
        )  # fmt: skip
        self._terminal_started = True

    def _read_terminal(self) -> TerminalRead:
        from sandbox_service.backends.local import TERMINAL_ROWS, TMUX_SESSION, _cap_terminal_text

        history = self._tmux([["capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", TMUX_SESSION]]).rstrip()
        previous, self._terminal_seen = self._terminal_seen, history
        if history.startswith(previous):
            new_text = history[len(previous) :].lstrip("\n") if previous else history
        else:  # earlier text changed (clear, a full-screen program): the current screen
            new_text = "\n".join(history.splitlines()[-TERMINAL_ROWS:])
        return _cap_terminal_text(new_text, 10_000)

    def verify(self):
        raise SandboxLifecycleError("Harbor runs the verifier of a trial, not the agent")

    def close(self) -> None:
        """Harbor owns the environment; nothing of it is the agent's to close."""


# ---- settings --------------------------------------------------------------------------------------


def eval_settings(fields: dict[str, Any]):
    """`EvalSettings` from the agent's kwargs (strings from Harbor's command line are coerced to
    the field's type); a `harness` entry is a t1jax train / sft config whose harness section is
    read first, as `t1jax eval --harness` does. ValueError names a field that is not one."""
    from t1jax.eval.cli import read_harness_file
    from t1jax.eval.job import EvalSettings

    fields = dict(fields)
    merged: dict[str, Any] = {}
    if fields.get("harness"):
        merged.update(read_harness_file(Path(fields.pop("harness"))))
    fields.pop("harness", None)
    known = {f.name: f for f in dataclasses.fields(EvalSettings)}
    for name, value in fields.items():
        if name not in known or name in ("tasks_dir", "attempts", "task_sample", "rescore_of"):
            raise ValueError(f"{name} is not a t1jax agent setting")
        merged[name] = _coerce(value, known[name])
    return EvalSettings(tasks_dir="(harbor)", **merged)


def _coerce(value: Any, field: dataclasses.Field) -> Any:
    if not isinstance(value, str):
        return value
    kind = str(field.type)
    if value.lower() in ("none", "null") and "None" in kind:
        return None
    if kind.startswith("bool"):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{field.name} must be true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    for name, cast in (("int", int), ("float", float)):
        if kind.startswith(name):
            try:
                return cast(value)
            except ValueError:
                raise ValueError(f"{field.name} must be a number, got {value!r}") from None
    return value


# ---- the worker ------------------------------------------------------------------------------------


class Worker:
    def __init__(self, channel: _Channel, settings, agent, harness) -> None:
        self.channel, self.settings, self.agent, self.harness = channel, settings, agent, harness
        self.cancels: dict[str, threading.Event] = {}

    def agent_info(self) -> dict[str, Any]:
        from t1jax.harbor.records import t1jax_version

        info: dict[str, Any] = {"name": "t1jax", "version": t1jax_version(), "mode": self.settings.agent}
        if self.settings.agent == "model":
            checkpoint = str(self.settings.checkpoint)
            info["model_info"] = {"name": Path(checkpoint).name or checkpoint, "provider": "t1jax"}
        return info

    def start_trial(self, message: dict) -> None:
        trial_id = str(message["trial"])
        cancel = self.cancels.setdefault(trial_id, threading.Event())
        threading.Thread(target=self._trial, args=(message, cancel), name=f"t1jax-trial-{trial_id}", daemon=True).start()

    def _trial(self, message: dict, cancel: threading.Event) -> None:
        from sandbox_service.tasks import load_task
        from t1jax.agent.harness import run_trial
        from t1jax.harbor.atif import trajectory_record
        from t1jax.runtime.scheduler import TrialFate
        from t1jax.tito.types import TrialStatus

        trial_id = str(message["trial"])
        try:
            task = load_task(message["task_dir"])
            if message.get("instruction"):  # Harbor's (a step's, for a multi-step task)
                task = dataclasses.replace(task, instruction=str(message["instruction"]))
            self.agent.register(SimpleNamespace(trial_id=trial_id, task=task))
            sandbox = HarborSandbox(self.channel, trial_id, task)
            trajectory = run_trial(
                task, sandbox, self.agent.sampler, self.agent.tokenizer, self.harness, trial_id=trial_id,
                sampling=self.settings.sampling, cancel_event=cancel,
            )  # fmt: skip
            fate = TrialFate.CANCELLED if trajectory.status is TrialStatus.ABORTED and cancel.is_set() else TrialFate.COMPLETED
            record = trajectory_record(SimpleNamespace(trajectory=trajectory, fate=fate, cause=None),
                                       self.agent.tokenizer.decode, self.agent_info())  # fmt: skip
            turns = [turn for segment in trajectory.segments for turn in segment.turns]
            summary = {
                "status": trajectory.status.value, "cause": trajectory.cause.value, "detail": trajectory.detail[:2000],
                "action_turns": trajectory.stats.action_turns,
                "prompt_tokens": sum(len(t.prompt_ids) for t in turns),
                "completion_tokens": sum(len(t.completion_ids) for t in turns),
            }  # fmt: skip
            self.channel.send({"op": "done", "trial": trial_id, "atif": record, "summary": summary})
        except Exception as error:  # reported to the agent, which raises it in Harbor's trial
            detail = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
            self.channel.send({"op": "done", "trial": trial_id, "error": detail})
        finally:
            self.cancels.pop(trial_id, None)

    def cancel(self, trial_id: str) -> None:
        event = self.cancels.get(trial_id)
        if event is not None:
            event.set()


def _open(start: dict):
    from t1jax.eval.cli import build_agent

    settings = eval_settings(start.get("settings") or {})
    if settings.agent == "model":
        from t1jax.checkpoints import parse_dtype, resolve_checkpoint

        resolve_checkpoint(settings.checkpoint)
        parse_dtype(settings.dtype)
    args = argparse.Namespace(devices=start.get("devices"), concurrency=int(start.get("concurrency") or 4))
    agent = build_agent(settings, args)
    settings = dataclasses.replace(settings, context_window=agent.context_window)
    return settings, agent, agent.harness(settings)


def main() -> int:
    # The pipe is the real stdout; everything else that prints goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    channel = _Channel(out)
    first = sys.stdin.readline()
    try:
        start = json.loads(first)
        if start.get("op") != "start":
            raise ValueError(f"the first message must be start, got {start.get('op')!r}")
        settings, agent, harness = _open(start)
    except Exception as error:
        channel.send({"op": "fatal", "error": f"{type(error).__name__}: {error}".splitlines()[0]})
        return 2
    worker = Worker(channel, settings, agent, harness)
    channel.send({"op": "ready", "context_window": settings.context_window, "agent_info": worker.agent_info(),
                  "harness": {"prompt_profile": harness.prompt_profile, "terminal": str(harness.terminal),
                              "max_turns": harness.max_turns}})  # fmt: skip
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            message = json.loads(line)
            op = message.get("op")
            if op == "result":
                channel.answer(message)
            elif op == "trial":
                worker.start_trial(message)
            elif op == "cancel":
                worker.cancel(str(message["trial"]))
    finally:  # the agent's process went away: end every trial, close the engine
        channel.fail_all("the Harbor agent closed the pipe")
        for event in list(worker.cancels.values()):
            event.set()
        agent.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
