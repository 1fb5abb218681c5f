"""The `Sandbox` contract on top of a remote container that can only "run a program with stdin".

This module owns what the Kubernetes and Modal backends have in common: both reach their container
through one primitive, `run(argv, stdin, timeout) -> (stdout, stderr, finished)` (pod exec over a
websocket; `modal.Sandbox.exec`), and build `exec`, `send_keys`, file copy and `verify` from small
bash scripts sent over stdin. The scripts are ordinary bash + coreutils + tar (+ tmux for
`send_keys`), which is what the task image must provide.

How one `exec` works: the script runs the command in its own session (`setsid`) with output
redirected to files in `/tmp/.t1jax`, a watchdog kills the whole process group at the deadline and
leaves a flag, and the script then prints the head and tail of each file (sizes measured once, so
a background writer cannot skew them) and a trailer line `T1JAX_END_<nonce> rc timed_out
stdout_size stderr_size`. So output volume over the wire is bounded, a command that leaves a
background process does not hang the call, and the timeout kills children too.

Invariants:
- Scripts travel on stdin, never in argv (no argv size limit, no quoting of user text in URLs):
  the bootstrap `read`s exactly the script's byte count, so data after it (a tar stream) stays on
  stdin for the script.
- `close()` is idempotent and thread-safe; calls racing with it fail with `SandboxClosed`.
- Output kept by `exec` is at most `output_limit_bytes` per stream (half head, half tail).
"""

from __future__ import annotations

import abc
import dataclasses
import io
import secrets
import shlex
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox_service import reports
from sandbox_service.backends._proc import DEFAULT_PATH
from sandbox_service.contracts import ExecResult, FailureCause, Task, TerminalRead, VerifierReport
from sandbox_service.errors import BackendError, BadRequest, SandboxClosed, SandboxStateError
from sandbox_service.verifier import (
    REPORT_DIR,
    TEST_PACKAGES_SUBDIR,
    TESTS_DIR,
    TOOLCHAIN_MOUNT,
    VERIFIER_TMP,
    PackageInstallFailed,
    Toolchain,
    ToolchainMissing,
    VerifierPlan,
    diff_manifests,
    install_test_packages,
    manifest_of_sources,
    plan_verifier,
    task_tests_sources,
)

STATE_DIR = "/tmp/.t1jax"
TMUX_SESSION = "t1jax"
TMUX_COLUMNS, TMUX_ROWS = 160, 40
VERIFIER_LOG_DIR = REPORT_DIR
AGENT_LOG_DIR = "/logs/agent"
DEFAULT_OUTPUT_LIMIT_BYTES = 64 * 1024
# The verifier's console output is parsed (pytest's summary comes last): keep much more of it.
VERIFIER_OUTPUT_LIMIT_BYTES = 4 * 1024 * 1024
VERIFIER_OUTPUT_TAIL_BYTES = 8 * 1024  # what a VerifierReport keeps of it (output_tail)
# Extra wall-clock a `run` gets beyond the command's own deadline before the caller gives up on
# the transport (the in-container watchdog should always answer first).
TRANSPORT_GRACE_SEC = 30.0
# What the verifier's environment starts from in a container (the task's env is added on top).
REMOTE_BASE_ENV = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "xterm-256color"}


@dataclass(frozen=True)
class RunOutput:
    """What one `run` returned. `finished` is False when the transport gave up at its deadline."""

    stdout: bytes
    stderr: bytes
    finished: bool


def bootstrap_argv(script: bytes) -> list[str]:
    """argv that reads exactly len(script) bytes of stdin as a bash script and runs it. The byte
    count is exact in the C locale; the script itself then runs in the container's own locale."""
    return ["bash", "-c", f'LC_ALL=C IFS= read -r -N {len(script)} t1jax_script; eval "$t1jax_script"']


def join_head_tail(head: bytes, tail: bytes, omitted: int) -> str:
    """One string for output whose middle was cut: head, a note naming the cut, tail."""
    if omitted <= 0:
        return (head + tail).decode("utf-8", "replace")
    note = f"\n[... {omitted} bytes omitted ...]\n".encode()
    return (head + note + tail).decode("utf-8", "replace")


def exec_script(
    command: str, timeout_sec: float, *, workdir: str, nonce: str, output_limit_bytes: int
) -> bytes:
    head, tail = output_limit_bytes // 2, output_limit_bytes - output_limit_bytes // 2
    q = shlex.quote
    return f"""
exec 3>&2 2>/dev/null  # job-control chatter ("Killed ...") must not reach the caller's stderr
t1=/tmp/.t1jax; mkdir -p "$t1"
out="$t1/{nonce}.out"; err="$t1/{nonce}.err"; flag="$t1/{nonce}.timeout"; group="$t1/{nonce}.group"
cd {q(workdir)} 2>/dev/null || cd /
# The watchdog is forked before the command: a command that takes every process the sandbox may
# have (a fork bomb) would otherwise leave no process for it, and the call would hang past the
# deadline. It learns the command's group from a file written right after the command's fork.
setsid bash -c 'sleep "$1"; : >"$2"; read -r g <"$3" && kill -KILL -- -"$g"' t1jax-watchdog \
  {timeout_sec:.3f} "$flag" "$group" </dev/null >/dev/null 2>&1 3>&- &
dog=$!
setsid bash -c {q(command)} </dev/null >"$out" 2>"$err" 3>&- &
child=$!
echo "$child" >"$group"
echo "$child" >>"$t1/groups"
wait "$child"; rc=$?
kill -KILL -- -"$dog" "$dog"  # the pid too, in case it has not reached setsid() yet
timed=0; [ -e "$flag" ] && timed=1
# A killed group's processes hold the sandbox's pids until the container's init reaps them (kill -0
# still reaches a zombie): answer once they are gone (at most ~5 s), so the next command does not
# find a flood's slots still taken.
if [ "$timed" = 1 ]; then
  n=0; while kill -0 -- -"$child" 2>/dev/null && [ "$n" -lt 100 ]; do sleep 0.05; n=$((n+1)); done
fi
osz=$(wc -c <"$out" 2>/dev/null); osz=$((osz+0))
esz=$(wc -c <"$err" 2>/dev/null); esz=$((esz+0))
t1emit() {{
  if [ "$1" -le {output_limit_bytes} ]; then head -c "$1" "$2"
  else head -c {head} "$2"; head -c "$1" "$2" | tail -c {tail}; fi
}}
t1emit "$osz" "$out"
printf '\\nT1JAX_END_{nonce} %s %s %s %s\\n' "$rc" "$timed" "$osz" "$esz"
t1emit "$esz" "$err" >&3
rm -f "$out" "$err" "$flag" "$group"
""".encode()


def _split_kept(kept: bytes, size: int, limit: int) -> tuple[str, int]:
    if size <= limit:
        return kept.decode("utf-8", "replace"), 0
    head = limit // 2
    return join_head_tail(kept[:head], kept[head:], size - limit), size - limit


def parse_exec_output(
    output: RunOutput, nonce: str, *, output_limit_bytes: int, duration_sec: float
) -> ExecResult:
    """Turn the bytes an `exec_script` printed into an `ExecResult`."""
    marker = f"\nT1JAX_END_{nonce} ".encode()
    position = output.stdout.rfind(marker)
    if position < 0:
        if not output.finished:
            return ExecResult(
                stdout="",
                stderr="[t1jax] the sandbox did not answer before the deadline; the command was abandoned",
                exit_code=None,
                timed_out=True,
                duration_sec=duration_sec,
            )
        # The wrapper died before reporting: it could not fork (the sandbox at its pids limit, e.g.
        # a fork bomb still running), was OOM-killed, or the image lacks bash/coreutils. The command
        # failed; the trial goes on, as a shell prompt would after "fork: retry".
        transport = output.stderr[-2000:].decode("utf-8", "replace").strip()
        return ExecResult(
            stdout=output.stdout.decode("utf-8", "replace"),
            stderr="[t1jax] the command's wrapper ended without reporting its result (the sandbox "
            "may be out of processes or memory, or the image lacks bash/coreutils)"
            + (f": {transport}" if transport else ""),
            exit_code=None,
            timed_out=False,
            duration_sec=duration_sec,
        )
    fields = output.stdout[position + len(marker) :].split(b"\n", 1)[0].split()
    rc, timed, stdout_size, stderr_size = (int(value) for value in fields)
    stdout, stdout_omitted = _split_kept(output.stdout[:position], stdout_size, output_limit_bytes)
    stderr, stderr_omitted = _split_kept(output.stderr, stderr_size, output_limit_bytes)
    timed_out = bool(timed)
    return ExecResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=None if timed_out else rc,
        timed_out=timed_out,
        duration_sec=duration_sec,
        stdout_omitted_bytes=stdout_omitted,
        stderr_omitted_bytes=stderr_omitted,
    )


def terminal_script(keys: str, wait_sec: float, start_line: int, *, workdir: str, nonce: str) -> bytes:
    """Start the tmux session if needed, type `keys`, wait, then print the pane from absolute line
    `start_line` (history included) through the cursor line, or the visible screen when that line is
    no longer in the history (limit reached, history cleared)."""
    q = shlex.quote
    send = f"tmux send-keys -t {TMUX_SESSION} -- {q(keys)}" if keys else ":"
    return f"""
if ! tmux has-session -t {TMUX_SESSION} 2>/dev/null; then  # bash -i, not a login shell: /etc/profile
  # would reset the image's ENV PATH
  cd {q(workdir)} 2>/dev/null || cd /
  shell=$(command -v bash || echo sh)
  tmux start-server \\; set-option -g history-limit 50000 \\; \\
    new-session -d -s {TMUX_SESSION} -x {TMUX_COLUMNS} -y {TMUX_ROWS} "$shell" || exit 97
fi
{send} || exit 98
sleep {wait_sec:.3f}
set -- $(tmux display-message -p -t {TMUX_SESSION} '#{{history_size}} #{{cursor_y}} #{{history_limit}}')
h=$1; y=$2; limit=$3; start={start_line}
if [ "$h" -ge "$limit" ] || [ "$start" -gt $((h + y)) ] || [ "$start" -lt 0 ]; then
  mode=screen; tmux capture-pane -p -t {TMUX_SESSION}
else
  mode=incremental; tmux capture-pane -p -t {TMUX_SESSION} -S $((start - h)) -E "$y"
fi
printf '\\nT1JAX_END_{nonce} %s %s %s\\n' "$mode" "$h" "$y"
""".encode()


class TerminalCursor:
    """Where the previous terminal read ended, so the next read returns only what is new."""

    def __init__(self) -> None:
        self.next_line = 0  # absolute pane line (history included) of the cursor at the last read
        self.last_line_text = ""  # what that line showed then (typically the prompt)

    def consume(self, output: RunOutput, nonce: str, *, output_limit_bytes: int) -> TerminalRead:
        marker = f"\nT1JAX_END_{nonce} ".encode()
        position = output.stdout.rfind(marker)
        if position < 0:
            detail = output.stderr[-2000:].decode("utf-8", "replace")
            raise BackendError(f"the terminal script failed (is tmux installed in the image?): {detail}")
        mode, history, cursor = output.stdout[position + len(marker) :].split(b"\n", 1)[0].split()
        lines = output.stdout[:position].decode("utf-8", "replace").split("\n")
        # The cursor row of the previous read comes back, now possibly extended ("$ " -> "$ ls"):
        # drop the part the caller has already seen.
        if mode == b"incremental" and lines and lines[0].startswith(self.last_line_text):
            lines[0] = lines[0][len(self.last_line_text) :]
        self.next_line = int(history) + int(cursor)
        self.last_line_text = lines[-1] if lines else ""
        while lines and not lines[-1].strip():
            lines.pop()
        text = "\n".join(lines).encode()
        if len(text) <= output_limit_bytes:
            return TerminalRead(text=text.decode("utf-8", "replace"))
        head = output_limit_bytes // 2
        omitted = len(text) - output_limit_bytes
        return TerminalRead(
            text=join_head_tail(text[:head], text[len(text) - (output_limit_bytes - head) :], omitted),
            omitted_bytes=omitted,
        )


def tar_directory(
    local_dir: Path,
    *,
    extra_files: dict[str, Path] | None = None,
    replace_files: dict[str, bytes] | None = None,
    skip_dirs: frozenset[str] = frozenset(),
    gzip_level: int | None = None,
) -> bytes:
    """A tar of local_dir's contents (owners root, modes kept, symlinks as symlinks), plus
    `extra_files` (archive name -> local file) at the top level. `replace_files` (archive name ->
    content, mode 0755) overrides entries; directories named in `skip_dirs` are left out."""
    replace_files = dict(replace_files or {})
    buffer = io.BytesIO()
    mode = "w" if gzip_level is None else "w:gz"
    options = {} if gzip_level is None else {"compresslevel": gzip_level}
    with tarfile.open(fileobj=buffer, mode=mode, format=tarfile.PAX_FORMAT, **options) as archive:

        def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            if Path(info.name).name in skip_dirs and info.isdir():
                return None
            if info.name in replace_files:
                return None
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            return info

        for entry in sorted(local_dir.iterdir()):
            archive.add(entry, arcname=entry.name, filter=normalize)
        for name, path in (extra_files or {}).items():
            archive.add(path, arcname=name, filter=normalize)
        for name, content in replace_files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(content), 0o755
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def put_tree_script(remote_dir: str, tar_size: int, *, replace: bool, gzip: bool = False) -> bytes:
    q = shlex.quote
    clear = f"rm -rf {q(remote_dir)} && " if replace else ""
    unpack = f"head -c {tar_size} | tar -x{'z' if gzip else ''}f - -C {q(remote_dir)} --no-same-owner"
    return f"{clear}mkdir -p {q(remote_dir)} && {unpack}\n".encode()


def manifest_script(remote_dir: str, nonce: str) -> bytes:
    """Print `F <sha256>\t<path>` per file and `L <target>\t<path>` per symlink under remote_dir,
    the same record `verifier.tests_manifest` makes on the host."""
    return f"""
cd {shlex.quote(remote_dir)} || exit 3
find . \\( -type f -o -type l \\) -print | LC_ALL=C sort | while IFS= read -r entry; do
  if [ -L "$entry" ]; then printf 'L %s\\t%s\\n' "$(readlink "$entry")" "$entry"
  else printf 'F %s\\t%s\\n' "$(sha256sum <"$entry" | cut -d' ' -f1)" "$entry"; fi
done
echo T1JAX_END_{nonce} $?
""".encode()


def parse_manifest(text: str) -> dict[str, str]:
    manifest = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        value, tab, path = rest.partition("\t")
        if kind not in ("F", "L") or not tab or not path.startswith("./"):
            continue
        manifest[path[2:]] = value if kind == "F" else "symlink:" + value
    return manifest


def kill_agent_script() -> bytes:
    """Kill everything the agent may have left running: the tmux server, every process group the
    exec wrapper started, then every process of the container except its init and this shell
    (`kill -1` is safe only because a container has its own pid namespace)."""
    return f"""
tmux kill-server 2>/dev/null
if [ -f {STATE_DIR}/groups ]; then
  while read -r group; do kill -KILL -- -"$group" 2>/dev/null; done <{STATE_DIR}/groups
fi
kill -KILL -1 2>/dev/null
exit 0
""".encode()


def remote_verifier_plan(task: Task) -> VerifierPlan:
    """`verifier.plan_verifier` for a container without a pristine copy of its image: the same rule
    and report options as the other backends, on the container's own python3 and bash."""
    return plan_verifier(task, {**REMOTE_BASE_ENV, **task.environment.env, **task.verifier_env})


def require_toolchain(directory: Path) -> Toolchain:
    """The verifier toolchain a remote backend copies in at verify time; checked at `create` so a
    misconfigured service fails before it starts a Pod, not after the agent's work."""
    try:
        return Toolchain.at(directory)
    except ToolchainMissing as error:
        raise BackendError(str(error)) from error


class ContainerSandbox(abc.ABC):
    """A `Sandbox` driven through `_run`; subclasses implement `_run` and `_terminate`."""

    # What the container is called in errors ("pod", "Modal sandbox").
    container_kind = "container"

    def __init__(
        self,
        sandbox_id: str,
        task: Task,
        *,
        toolchain_dir: Path,
        output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES,
    ):
        self._sandbox_id = sandbox_id
        self._toolchain_dir = toolchain_dir
        self._task = task
        self.output_limit_bytes = output_limit_bytes
        self._terminal = TerminalCursor()
        self._close_lock = threading.Lock()
        self._closed = False
        self._verified = False

    # ---- what a backend provides ---------------------------------------------------------------------

    @abc.abstractmethod
    def _run(self, argv: list[str], stdin: bytes, timeout_sec: float, *, as_root: bool = False) -> RunOutput:
        """Run argv in the container with stdin; give up after timeout_sec (finished=False).
        `as_root`: as uid 0 rather than the image's user, where the backend can choose (the service's
        own scripts need it; the agent's commands never get it)."""

    @abc.abstractmethod
    def _terminate(self) -> None:
        """Destroy the container (idempotent; may run while a `_run` is in flight)."""

    def prepare(self) -> None:
        """Create the directories Harbor tasks expect and fail fast if the image lacks bash."""
        script = f"mkdir -p {AGENT_LOG_DIR} {VERIFIER_LOG_DIR} {STATE_DIR} && echo T1JAX_READY\n".encode()
        output = self._run(bootstrap_argv(script), script, 120.0, as_root=True)
        if b"T1JAX_READY" not in output.stdout:
            detail = output.stderr[-1000:].decode("utf-8", "replace")
            raise BackendError(
                f"{self.container_kind} {self.sandbox_id} runs, but a bash script failed in it "
                f"(the image needs bash, coreutils and tar): {detail}"
            )

    # ---- Sandbox contract ----------------------------------------------------------------------------

    @property
    def sandbox_id(self) -> str:
        return self._sandbox_id

    @property
    def task(self) -> Task:
        return self._task

    @property
    def closed(self) -> bool:
        return self._closed

    def _checked_run(
        self, script: bytes, timeout_sec: float, action: str, payload: bytes = b"", *, as_root: bool = True
    ) -> RunOutput:
        if self._closed:
            raise SandboxClosed(f"cannot {action}: sandbox {self._sandbox_id} is closed")
        try:
            output = self._run(bootstrap_argv(script), script + payload, timeout_sec, as_root=as_root)
        except Exception as error:
            if self._closed:
                raise SandboxClosed(f"{action} interrupted: sandbox {self._sandbox_id} was closed") from error
            if isinstance(error, BackendError | SandboxClosed):
                raise
            raise BackendError(f"{action} in sandbox {self._sandbox_id} failed: {error}") from error
        if self._closed:  # closed while the call ran: whatever came back is cut short
            raise SandboxClosed(f"{action} interrupted: sandbox {self._sandbox_id} was closed")
        return output

    def exec_raw(
        self,
        command: str,
        timeout_sec: float,
        *,
        output_limit_bytes: int | None = None,
        as_root: bool = False,
    ) -> ExecResult:
        """`exec` without the agent-phase check (the verifier uses it, as root)."""
        limit = output_limit_bytes or self.output_limit_bytes
        nonce = secrets.token_hex(8)
        script = exec_script(
            command,
            timeout_sec,
            workdir=self._task.environment.workdir,
            nonce=nonce,
            output_limit_bytes=limit,
        )
        started = time.monotonic()
        output = self._checked_run(script, timeout_sec + TRANSPORT_GRACE_SEC, "exec", as_root=as_root)
        return parse_exec_output(
            output, nonce, output_limit_bytes=limit, duration_sec=time.monotonic() - started
        )

    def exec(self, command: str, timeout_sec: float) -> ExecResult:
        if self._verified:
            raise SandboxStateError(f"cannot exec in sandbox {self._sandbox_id}: verify() already ran")
        if not timeout_sec > 0:
            raise BadRequest(f"exec timeout_sec must be positive, got {timeout_sec}")
        return self.exec_raw(command, timeout_sec)

    def send_keys(self, keys: str, wait_sec: float) -> TerminalRead:
        if self._verified:
            raise SandboxStateError(f"cannot send keys to sandbox {self._sandbox_id}: verify() already ran")
        nonce = secrets.token_hex(8)
        script = terminal_script(
            keys,
            max(0.0, wait_sec),
            self._terminal.next_line,
            workdir=self._task.environment.workdir,
            nonce=nonce,
        )
        output = self._checked_run(script, wait_sec + TRANSPORT_GRACE_SEC, "send_keys", as_root=False)
        return self._terminal.consume(output, nonce, output_limit_bytes=self.output_limit_bytes)

    def verify(self) -> VerifierReport:
        """Stop the agent's processes, copy in the tests and the pinned pytest toolchain, check the
        tests against the task's manifest, run the verifier (`verifier.plan_verifier`'s rule) under
        the task's verifier deadline, fetch its report files and parse them (`reports`)."""
        if self._verified:
            raise SandboxStateError(f"verify() was already called for sandbox {self._sandbox_id}")
        self._verified = True
        task = self._task
        try:
            toolchain = Toolchain.at(self._toolchain_dir)
        except ToolchainMissing as error:
            return VerifierReport((), False, FailureCause.SANDBOX_ERROR, None, None, str(error))
        try:
            self._kill_agent()
            extra_files = {name: path for path, name in task_tests_sources(task) if name != "."}
            self.put_tree(task.tests_dir, TESTS_DIR, extra_files=extra_files)
            problems = diff_manifests(manifest_of_sources(task), self.remote_manifest(TESTS_DIR))
            if problems:
                detail = "tests differ from the task's after copying them in: " + ", ".join(problems[:10])
                return VerifierReport((), False, FailureCause.TESTS_TAMPERED, None, None, detail)
            # Not the host's test packages: built for its interpreters, and large (numpy, scipy); the
            # plan's own are installed for the container's python3 and copied (`_with_test_packages`).
            skip = frozenset({"__pycache__", TEST_PACKAGES_SUBDIR})
            self.put_tree(toolchain.directory, TOOLCHAIN_MOUNT, skip_dirs=skip, gzip_level=6)
            reset = (
                f"rm -rf {VERIFIER_LOG_DIR} {VERIFIER_TMP} && mkdir -p {VERIFIER_LOG_DIR} {VERIFIER_TMP}\n"
            )
            self._checked_run(reset.encode(), TRANSPORT_GRACE_SEC, "reset the verifier directories")
            plan = self._with_test_packages(remote_verifier_plan(task), toolchain)
            command = shlex.join(["env", "-i", *(f"{k}={v}" for k, v in plan.env.items()), *plan.argv])
            result = self.exec_raw(
                command,
                task.limits.verifier_timeout_sec,
                output_limit_bytes=VERIFIER_OUTPUT_LIMIT_BYTES,
                as_root=True,
            )
            with tempfile.TemporaryDirectory(prefix="t1jax-verifier-") as local_dir:
                for name in (reports.JUNIT_FILE, reports.CTRF_FILE, reports.REWARD_TXT, reports.REWARD_JSON):
                    data = self.read_file(f"{VERIFIER_LOG_DIR}/{name}", reports.MAX_REPORT_BYTES + 1)
                    if data is not None:
                        (Path(local_dir) / name).write_bytes(data)
                output = result.stdout + "\n" + result.stderr
                report = reports.build_report(
                    report_dir=Path(local_dir),
                    output=output,
                    exit_code=result.exit_code,
                    timed_out=result.timed_out,
                    detail=plan.note,
                )
                return dataclasses.replace(report, output_tail=output[-VERIFIER_OUTPUT_TAIL_BYTES:])
        except SandboxClosed:
            raise
        except BackendError as error:
            return VerifierReport((), False, FailureCause.SANDBOX_ERROR, None, None, str(error))

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._terminate()

    # ---- helpers for verify --------------------------------------------------------------------------

    def _with_test_packages(self, plan: VerifierPlan, toolchain: Toolchain) -> VerifierPlan:
        """`plan` with the packages the replaced test script would have installed (as the local and
        container backends provide them: `verifier.install_test_packages`, on the service's host,
        for the container's own python3 version) copied into the container's toolchain directory;
        unchanged but for a note saying why where they cannot be had."""
        if plan.mode != "pytest" or not plan.requirements:
            return plan
        wanted = ", ".join(plan.requirements)
        probe = self.exec_raw("python3 -c 'import sys; print(*sys.version_info[:2])'", 60, as_root=True)
        try:
            major, minor = (int(part) for part in probe.stdout.split()[-2:])
        except ValueError:
            return dataclasses.replace(plan, note=f"{plan.note}; without {wanted}: no python3 version found")
        try:
            directory = install_test_packages(toolchain, plan.requirements, (major, minor))
        except PackageInstallFailed as error:
            note = f"{plan.note}; without {wanted}: installing them failed: {error}"
            return dataclasses.replace(plan, note=note)
        remote = f"{TOOLCHAIN_MOUNT}/{TEST_PACKAGES_SUBDIR}/{directory.name}"
        self.put_tree(directory, remote, skip_dirs=frozenset({"__pycache__"}), gzip_level=6)
        note = f"{plan.note}; with {wanted} (installed from PyPI by the service, copied in)"
        return dataclasses.replace(plan, env={**plan.env, "T1JAX_TEST_PACKAGES": remote}, note=note)

    def _kill_agent(self) -> None:
        self._checked_run(kill_agent_script(), TRANSPORT_GRACE_SEC, "stop the agent's processes")

    def put_tree(
        self,
        local_dir: Path,
        remote_dir: str,
        *,
        extra_files: dict[str, Path] | None = None,
        replace_files: dict[str, bytes] | None = None,
        skip_dirs: frozenset[str] = frozenset(),
        gzip_level: int | None = None,
    ) -> None:
        """Replace remote_dir with local_dir's contents (see `tar_directory`) via tar over exec."""
        archive = tar_directory(
            local_dir,
            extra_files=extra_files,
            replace_files=replace_files,
            skip_dirs=skip_dirs,
            gzip_level=gzip_level,
        )
        script = put_tree_script(remote_dir, len(archive), replace=True, gzip=gzip_level is not None)
        nonce = secrets.token_hex(8)
        script += f"echo T1JAX_END_{nonce} $?\n".encode()
        output = self._checked_run(script, 120.0 + len(archive) / 1e6, "copy files", payload=archive)
        if f"T1JAX_END_{nonce} 0".encode() not in output.stdout:
            raise BackendError(
                f"copying {local_dir} to {remote_dir} in sandbox {self._sandbox_id} failed: "
                f"{output.stderr[-2000:].decode('utf-8', 'replace')}"
            )

    def remote_manifest(self, remote_dir: str) -> dict[str, str]:
        nonce = secrets.token_hex(8)
        output = self._checked_run(manifest_script(remote_dir, nonce), 120.0, "checksum files")
        if f"T1JAX_END_{nonce} 0".encode() not in output.stdout:
            raise BackendError(f"checksumming {remote_dir} in sandbox {self._sandbox_id} failed")
        return parse_manifest(output.stdout.decode("utf-8", "replace"))

    def read_file(self, remote_path: str, max_bytes: int = 16 << 20) -> bytes | None:
        """The file's first max_bytes, or None if it does not exist (or is not a regular file)."""
        nonce = secrets.token_hex(8)
        q = shlex.quote(remote_path)
        script = (
            f"if [ -f {q} ] && [ ! -L {q} ]; then echo T1JAX_FILE_{nonce}; head -c {max_bytes} {q}; "
            f"else echo T1JAX_NOFILE_{nonce}; fi\n"
        )
        output = self._checked_run(script.encode(), 120.0, "read a file")
        found = f"T1JAX_FILE_{nonce}\n".encode()
        if output.stdout.startswith(found):
            return output.stdout[len(found) :]
        return None
