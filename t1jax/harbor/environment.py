"""The sandbox service as a Harbor environment: `harbor run --environment-import-path
t1jax.harbor.environment:T1jaxEnvironment` runs each trial in one of our sandboxes (the local
bubblewrap backend by default, `--ek backend=container` for podman, `--ek url=URL` for a running
sandbox service), so a Harbor user gets its isolation and its verifier's integrity rules.

Loaded by Harbor (Python 3.12, its own venv): this module imports `harbor` and `sandbox_service`
(standard library only), never the rest of t1jax.

How Harbor's calls map onto a `sandbox_service.contracts.Sandbox` (which offers only `exec`,
`send_keys`, `verify` and `close`):
- `start` loads the task from the environment directory's parent (Harbor's task layout) with
  `sandbox_service.tasks.load_task` and creates its sandbox; a task the backend cannot build is
  Harbor's `SandboxBuildFailedError` (not retried).
- `exec` is the sandbox's `exec` (bash in the task's workdir) with Harbor's env overlays exported
  and `cwd` entered first. Commands run as the task image's user: the sandbox has no per-command
  user, so Harbor's `user` is not honoured.
- Files move through `exec` (base64 in chunks, tar for directories): the sandbox has no file API.

Verification, the integrity guarantee (the point of this environment): Harbor's own verifier
copies `tests/` into the environment, runs `test.sh` there and reads `/logs/verifier/reward.*`
back, all in the agent's sandbox, where an agent can plant a `conftest.py`, a fake `pytest` or a
reward file. Here the tests never enter the agent's sandbox:
- an upload into /tests is not performed; it marks the verification as due (our sandbox copies
  the task's tests itself at verify time, checked against the checksums taken at create);
- the test entry point Harbor then runs (the command that starts with the /tests script) is
  `Sandbox.verify()`: the task's verifier under the sandbox's own rules, in its own mount namespace;
- `/logs/verifier` is then downloaded from what that verifier reported (`reward.txt`, `ctrf.json`,
  `report.json`, `test-stdout.txt`), never from the agent's sandbox, so a planted reward file is
  never read; a tampered tests directory is reported as reward 0 with cause `tests_tampered`.

Invariant: after the agent phase, Harbor reads a reward only from `Sandbox.verify()`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shlex
import tarfile
import tempfile
import threading
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.trial.paths import EnvironmentPaths

from t1jax.harbor import records

ENVIRONMENT_TYPE = "t1jax"
# One command line carries at most this much base64 (Linux caps one argument at 128 KiB).
_CHUNK_CHARS = 96_000
# A read returns at most this many bytes of a file (the sandbox keeps 1 MiB of output).
_READ_BYTES = 384 * 1024
_DEFAULT_EXEC_SEC = 3600.0

_providers: dict[tuple, Any] = {}
_providers_lock = threading.Lock()


def _provider(backend: str, url: str | None, cache_dir: str | None, allow_internet: bool):
    """One provider per setting in this process, shared by every trial of the job (a backend
    caches built environments)."""
    key = (backend, url, cache_dir, allow_internet)
    with _providers_lock:
        if key not in _providers:
            if url:
                from sandbox_service.client import SandboxServiceClient

                _providers[key] = SandboxServiceClient(url)
            else:
                from sandbox_service.providers import DEFAULT_CACHE_DIR, ProviderSettings, open_provider

                settings = ProviderSettings(
                    backend=backend, cache_dir=Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR,
                    allow_internet=allow_internet,
                )  # fmt: skip
                _providers[key] = open_provider(settings)
        return _providers[key]


class T1jaxEnvironment(BaseEnvironment):
    """A Harbor environment backed by one t1jax sandbox per trial (module docstring).

    kwargs (`--ek NAME=VALUE`): `backend` (local | container | any `sandbox_service` backend),
    `url` (a running `python -m sandbox_service serve`; overrides `backend`), `cache_dir` (the
    backend's built environments; default `.cache/sandbox_service`), `allow_internet` (let tasks
    that allow the network reach it; default off)."""

    def __init__(
        self, *args: Any, backend: str = "local", url: str | None = None, cache_dir: str | None = None,
        allow_internet: bool | str = False, **kwargs: Any,
    ) -> None:  # fmt: skip
        self._backend_name = str(backend)
        self._url = url
        self._cache_dir = cache_dir
        self._allow_internet = str(allow_internet).lower() in ("1", "true", "yes")
        self._task = None
        self._sandbox = None
        self._verification_due = False
        self._verified_files: dict[str, bytes] | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return ENVIRONMENT_TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # Sandboxes are offline unless the task allows the network and `allow_internet` is set.
        return EnvironmentCapabilities(disable_internet=True)

    @property
    def task_dir(self) -> Path:
        return Path(self.environment_dir).resolve().parent

    def _validate_definition(self) -> None:
        from sandbox_service.tasks import TaskLoadError, load_task

        try:
            self._task = load_task(self.task_dir)
        except TaskLoadError as error:
            raise SandboxBuildFailedError(f"t1jax cannot load the task at {self.task_dir}: {error}") from None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        from sandbox_service.contracts import UnsupportedEnvironment

        provider = _provider(self._backend_name, self._url, self._cache_dir, self._allow_internet)
        try:
            self._sandbox = await asyncio.to_thread(provider.create, self._task, run_id=f"harbor-{self.session_id}")
        except UnsupportedEnvironment as error:
            raise SandboxBuildFailedError(f"{self._backend_name}: {error}") from None

    async def stop(self, delete: bool) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await asyncio.to_thread(sandbox.close)

    # ---- commands ----------------------------------------------------------------------------------

    async def exec(
        self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
        timeout_sec: int | None = None, user: str | int | None = None,
    ) -> ExecResult:  # fmt: skip
        self.logger.debug(f"t1jax exec: {command[:200]!r}")
        if self._verification_due and self._is_test_entry_point(command):
            return await self._verify()
        if self._verification_due and self._touches_tests(command):
            # chmod of the test script: our verifier runs the task's own copy, never this one
            return ExecResult(stdout="", stderr="", return_code=0)
        lines = [f"export {name}={shlex.quote(value)}" for name, value in (self._merge_env(env) or {}).items()]
        if cwd:
            lines.append(f"cd {shlex.quote(str(cwd))}")
        script = "\n".join([*lines, command]) if lines else command
        return await self._run(script, float(timeout_sec) if timeout_sec else _DEFAULT_EXEC_SEC)

    async def _run(self, command: str, timeout_sec: float) -> ExecResult:
        if self._sandbox is None:
            raise RuntimeError("the t1jax environment is not started")
        result = await asyncio.to_thread(self._sandbox.exec, command, timeout_sec)
        code = result.exit_code if result.exit_code is not None else 124
        stderr = result.stderr
        if result.timed_out:
            stderr += f"\n[t1jax: command killed after {timeout_sec:g} s]"
        return ExecResult(stdout=result.stdout, stderr=stderr, return_code=code)

    async def _checked(self, command: str, what: str, timeout_sec: float = 600.0) -> ExecResult:
        result = await self._run(command, timeout_sec)
        if result.return_code != 0:
            raise RuntimeError(f"t1jax environment: {what} failed ({result.return_code}): {result.stderr[-500:]}")
        return result

    # ---- verification ------------------------------------------------------------------------------

    @property
    def _paths(self) -> EnvironmentPaths:
        return EnvironmentPaths.for_os(self.os)

    def _under(self, path: str | PurePosixPath, root: PurePosixPath) -> bool:
        return PurePosixPath(str(path)).is_relative_to(root)

    def _is_test_entry_point(self, command: str) -> bool:
        # Harbor runs it as `(/tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1`
        words = shlex.split(command) if command.strip() else []
        return bool(words) and self._under(words[0].strip("()"), self._paths.tests_dir)

    def _touches_tests(self, command: str) -> bool:
        return str(self._paths.tests_dir) + "/" in command

    async def _verify(self) -> ExecResult:
        """Harbor's test run, as the sandbox's own verifier (module docstring)."""
        report = await asyncio.to_thread(self._sandbox.verify)
        reward = records.verifier_reward(report)
        self._verified_files = {
            "reward.txt": f"{reward:g}\n".encode(),
            "ctrf.json": json.dumps(records.ctrf(report), indent=2).encode(),
            "report.json": json.dumps(records.verifier_report_json(report), indent=2).encode(),
            "test-stdout.txt": report.output_tail.encode(),
        }
        self._verification_due = False
        return ExecResult(  # Harbor reads the reward files, not this status
            stdout=report.output_tail[-4000:],
            stderr="" if report.parsed else f"t1jax verifier: {report.failure_cause.value}: {report.detail[:500]}",
            return_code=0 if report.parsed else 1,
        )

    # ---- files -------------------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        if self._under(target_path, self._paths.tests_dir):
            self._verification_due = True
            return
        await self._write_bytes(Path(source_path).read_bytes(), target_path)

    async def _write_bytes(self, data: bytes, target_path: str) -> None:
        target = shlex.quote(str(target_path))
        part = shlex.quote(f"{target_path}.t1jax-part-{uuid.uuid4().hex[:8]}")
        encoded = base64.b64encode(data).decode()
        await self._checked(f"mkdir -p \"$(dirname {target})\" && : > {part}", f"writing {target_path}")
        for start in range(0, len(encoded), _CHUNK_CHARS):
            chunk = encoded[start : start + _CHUNK_CHARS]
            await self._checked(f"printf %s {chunk} | base64 -d >> {part}", f"writing {target_path}")
        await self._checked(f"mv -f {part} {target}", f"writing {target_path}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        self.logger.debug(f"t1jax upload_dir {source_dir} -> {target_dir}")
        if self._under(target_dir, self._paths.tests_dir):
            # The tests stay out of the agent's sandbox: its verifier copies the task's own.
            self._verification_due = True
            return
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            for child in sorted(Path(source_dir).iterdir()):
                archive.add(child, arcname=child.name)
        remote = f"/tmp/.t1jax-upload-{uuid.uuid4().hex}.tar.gz"
        await self._write_bytes(buffer.getvalue(), remote)
        target = shlex.quote(str(target_dir))
        await self._checked(
            f"mkdir -p {target} && tar -xzf {remote} -C {target} --no-same-owner; status=$?; rm -f {remote}; "
            "exit $status",
            f"unpacking into {target_dir}",
        )

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        verified = self._verified_file(source_path)
        data = verified if verified is not None else await self._read_bytes(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def _verified_file(self, source_path: str) -> bytes | None:
        if not self._under(source_path, self._paths.verifier_dir):
            return None
        if self._verified_files is None:
            return None
        name = PurePosixPath(source_path).relative_to(self._paths.verifier_dir).as_posix()
        if name not in self._verified_files:
            raise FileNotFoundError(f"{source_path}: not among the verifier's outputs")
        return self._verified_files[name]

    async def _read_bytes(self, source_path: str) -> bytes:
        path = shlex.quote(str(source_path))
        size = int((await self._checked(f"stat -c %s {path}", f"reading {source_path}")).stdout.strip())
        data = bytearray()
        while len(data) < size:
            read = await self._checked(
                f"tail -c +{len(data) + 1} {path} | head -c {_READ_BYTES} | base64 -w0", f"reading {source_path}"
            )
            chunk = base64.b64decode(read.stdout.strip())
            if not chunk:
                break
            data += chunk
        return bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        self.logger.debug(f"t1jax download_dir {source_dir} -> {target_dir}")
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        if self._under(source_dir, self._paths.verifier_dir) and self._verified_files is not None:
            # What the sandbox's verifier reported; never what the agent left in /logs/verifier.
            for name, data in self._verified_files.items():
                (target / name).write_bytes(data)
            return
        remote = f"/tmp/.t1jax-download-{uuid.uuid4().hex}.tar.gz"
        source = shlex.quote(str(source_dir))
        await self._checked(f"tar -czf {remote} -C {source} .", f"packing {source_dir}")
        try:
            data = await self._read_bytes(remote)
        finally:
            await self._run(f"rm -f {remote}", 60)
        with tempfile.TemporaryDirectory() as scratch:
            archive = Path(scratch) / "dir.tar.gz"
            archive.write_bytes(data)
            with tarfile.open(archive) as tar:
                tar.extractall(target, filter="data")

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return (await self._run(f"test -d {shlex.quote(path)}", 60)).return_code == 0

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        return (await self._run(f"test -f {shlex.quote(path)}", 60)).return_code == 0

