"""A t1jax policy as a Harbor agent: `harbor run --agent-import-path t1jax.harbor.agent:T1jaxAgent`
(or `-a t1jax.harbor.agent:T1jaxAgent`) evaluates a t1jax checkpoint inside Harbor, on Harbor's
environments, with `t1jax eval`'s harness and prompt profile.

    harbor run -p TASKS -a t1jax.harbor.agent:T1jaxAgent -m CHECKPOINT [--ak prompt_profile=compact ...]
    harbor run -p TASKS -a t1jax.harbor.agent:T1jaxAgent --ak mode=oracle     # no model: the plumbing

How it reaches t1jax: Harbor needs Python >= 3.12 and imports this module in its own process; the
policy (JAX, the engine, the tokenizer) runs in a worker process, `python -m t1jax.eval.harbor_worker`,
started with the interpreter of t1jax's environment: the agent kwarg `python`, else
`$T1JAX_PYTHON`, else Harbor's own interpreter (t1jax installed with its dependencies beside
Harbor). One worker serves every trial of the job with the same settings (the model loads once and
the engine batches concurrent trials); the trial's commands come back over the pipe and run in
Harbor's environment (`t1jax.eval.harbor_worker` has the protocol). This module imports only Harbor and
the standard library.

Agent kwargs (`--ak NAME=VALUE`): `mode` (model | oracle | nop; model when `-m` names a
checkpoint), `python`, `concurrency` (the engine's batch, default 4), `devices`, and any
`t1jax eval` setting by its `EvalSettings` name: `harness` (a train / sft config whose harness
section the policy was trained in), `prompt_profile`, `terminal`, `max_turns`, `context_window`,
`max_tokens_per_turn`, `agent_timeout_sec`, `budget_note`, `temperature`, `top_p`, `top_k`,
`greedy`, `seed`, `dtype`, ...

Every trial writes `agent/trajectory.json` (ATIF with t1jax's training extension, as `t1jax eval`
writes it) and fills Harbor's `AgentContext` (token counts; `metadata`: the harness's status,
cause and turns). The harness's own deadline is the task's agent timeout; Harbor's timeout cancels
the trial in the worker too.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from harbor.models.trial.result import AgentInfo, ModelInfo

_AGENT_KWARGS = ("mode", "python", "concurrency", "devices")
_START_TIMEOUT_SEC = 1800.0  # loading and compiling a checkpoint on a slow host
_STOP_GRACE_SEC = 20.0  # for the worker to close its engine once the pipe closes


class WorkerError(RuntimeError):
    """The t1jax worker could not start, or failed a trial (its message says what was wrong)."""


class _Worker:
    """One `python -m t1jax.eval.harbor_worker` process and its pipe, shared by the trials of a job."""

    def __init__(self, python: str, start: dict) -> None:
        self.python, self.start_message = python, start
        self.process: asyncio.subprocess.Process | None = None
        self.ready: dict | None = None
        self.environments: dict[str, BaseEnvironment] = {}
        self.finished: dict[str, asyncio.Future] = {}
        self._write_lock = asyncio.Lock()
        self._reader: asyncio.Task | None = None
        self._started = asyncio.Lock()

    async def ensure(self) -> dict:
        async with self._started:
            if self.ready is not None and self.process is not None and self.process.returncode is None:
                return self.ready
            self.process = await asyncio.create_subprocess_exec(
                self.python, "-m", "t1jax.eval.harbor_worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=None, limit=1 << 30,
            )  # fmt: skip
            await self.send(self.start_message)
            line = await asyncio.wait_for(self.process.stdout.readline(), _START_TIMEOUT_SEC)
            if not line:
                code = await self.process.wait()
                raise WorkerError(f"the t1jax worker ({self.python}) exited {code} before it was ready")
            message = json.loads(line)
            if message.get("op") != "ready":
                raise WorkerError(f"t1jax worker: {message.get('error', message)}")
            self.ready = message
            self._reader = asyncio.get_running_loop().create_task(self._read())
            return message

    async def send(self, message: dict) -> None:
        async with self._write_lock:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            await self.process.stdin.drain()

    async def _read(self) -> None:
        try:
            while True:
                line = await self.process.stdout.readline()
                if not line:
                    break
                message = json.loads(line)
                op = message.get("op")
                if op == "exec":
                    asyncio.get_running_loop().create_task(self._exec(message))
                elif op == "done":
                    future = self.finished.pop(str(message["trial"]), None)
                    if future is not None and not future.done():
                        future.set_result(message)
        finally:  # the worker exited, or Harbor's loop is ending: the worker ends with it
            self.process.stdin.close()  # its end of the pipe: it stops every trial and exits
            try:
                code = await asyncio.wait_for(asyncio.shield(self.process.wait()), _STOP_GRACE_SEC)
            except (TimeoutError, asyncio.CancelledError):
                self.process.kill()
                code = await self.process.wait()
            for future in self.finished.values():
                if not future.done():
                    future.set_exception(WorkerError(f"the t1jax worker exited {code} during the trial"))
            self.finished.clear()
            self.ready = None

    async def _exec(self, message: dict) -> None:
        environment = self.environments.get(str(message["trial"]))
        reply: dict[str, Any] = {"op": "result", "call": message["call"]}
        timeout = float(message["timeout_sec"])
        started = time.monotonic()
        try:
            if environment is None:
                raise RuntimeError(f"no environment for trial {message['trial']}")
            result = await environment.exec(message["command"], timeout_sec=max(1, math.ceil(timeout)))
            elapsed = time.monotonic() - started
            reply.update(
                stdout=result.stdout or "", stderr=result.stderr or "", exit_code=result.return_code,
                timed_out=result.return_code == 124 and elapsed >= timeout, duration_sec=elapsed,
            )  # fmt: skip
        except Exception as error:
            reply["error"] = f"{type(error).__name__}: {error}"
        await self.send(reply)

    async def run_trial(self, trial_id: str, task_dir: Path, instruction: str, environment: BaseEnvironment) -> dict:
        await self.ensure()
        future = asyncio.get_running_loop().create_future()
        self.finished[trial_id] = future
        self.environments[trial_id] = environment
        try:
            await self.send({"op": "trial", "trial": trial_id, "task_dir": str(task_dir), "instruction": instruction})
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # Harbor's agent timeout: end the harness's trial too
            await self.send({"op": "cancel", "trial": trial_id})
            raise
        finally:
            self.environments.pop(trial_id, None)


_workers: dict[str, _Worker] = {}


class T1jaxAgent(BaseAgent):
    """A t1jax checkpoint (or the oracle / no-op policy) under `t1jax eval`'s harness (module
    docstring)."""

    def __init__(self, logs_dir: Path, model_name: str | None = None, *args: Any, **kwargs: Any) -> None:
        ours = {name: kwargs.pop(name) for name in list(kwargs) if name in _AGENT_KWARGS}
        settings = {name: kwargs.pop(name) for name in list(kwargs) if name not in _BASE_KWARGS}
        super().__init__(logs_dir, model_name, *args, **kwargs)
        mode = str(ours.get("mode") or ("model" if model_name else ""))
        if mode not in ("model", "oracle", "nop"):
            raise ValueError("the t1jax agent needs -m CHECKPOINT, or --ak mode=oracle / mode=nop")
        if mode == "model" and not model_name:
            raise ValueError("the t1jax agent's mode=model needs -m CHECKPOINT")
        settings["agent"] = mode
        if mode == "model":
            settings["checkpoint"] = model_name
        self.python = str(ours.get("python") or os.environ.get("T1JAX_PYTHON") or sys.executable)
        devices = ours.get("devices")
        self.start_message = {
            "op": "start", "settings": settings, "concurrency": int(ours.get("concurrency") or 4),
            "devices": None if devices in (None, "", "none") else int(devices),
        }  # fmt: skip
        self._step = 0

    @staticmethod
    def name() -> str:
        return "t1jax"

    def version(self) -> str | None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("t1jax")
        except PackageNotFoundError:
            return None

    def to_agent_info(self) -> AgentInfo:
        """As `t1jax eval` records a checkpoint's agent (`t1jax.harbor.records.agent_info`): the
        checkpoint directory's name, provider t1jax (not a LiteLLM provider parsed from a path)."""
        model = None
        if self.model_name:
            model = ModelInfo(name=Path(self.model_name).name or self.model_name, provider="t1jax")
        return AgentInfo(name=self.name(), version=self.version() or "unknown", model_info=model)

    def _worker(self) -> _Worker:
        key = json.dumps([self.python, self.start_message], sort_keys=True)
        if key not in _workers:
            _workers[key] = _Worker(self.python, self.start_message)
        return _workers[key]

    async def setup(self, environment: BaseEnvironment) -> None:
        await self._worker().ensure()  # load the policy before the agent's clock starts

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        task_dir = Path(environment.environment_dir).resolve().parent
        trial_id = self.session_id.removesuffix("__agent") if self.session_id else self.logs_dir.parent.name
        if self._step:  # a multi-step task calls run once per step
            trial_id = f"{trial_id}__step-{self._step + 1}"
        self._step += 1
        done = await self._worker().run_trial(trial_id, task_dir, instruction, environment)
        if "error" in done:
            raise WorkerError(f"t1jax worker failed the trial: {done['error']}")
        atif = done.get("atif")
        if atif is not None:
            name = "trajectory.json" if self._step == 1 else f"trajectory-step-{self._step}.json"
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            (self.logs_dir / name).write_text(json.dumps(atif, indent=2) + "\n")
        summary = done["summary"]
        context.n_input_tokens = (context.n_input_tokens or 0) + summary["prompt_tokens"]
        context.n_output_tokens = (context.n_output_tokens or 0) + summary["completion_tokens"]
        context.metadata = {**(context.metadata or {}), "t1jax": summary}


# Harbor's own constructor arguments (everything else an agent gets is a t1jax setting).
_BASE_KWARGS = frozenset(
    ("logger", "mcp_servers", "skills_dir", "extra_env", "base_url", "model_api_key_name", "model_api_format",
     "skip_model_parsing", "load_trajectory", "environment_logs_dir", "override_setup_timeout_sec",
     "task_dir", "trial_paths", "agent_timeout_sec")
)  # fmt: skip
