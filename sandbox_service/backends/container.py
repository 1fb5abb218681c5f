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
import hashlib
import io
import os
import re
import secrets
import shlex
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sandbox_service import reports
from sandbox_service.contracts import ExecResult, FailureCause, Task, TaskLayout, TerminalRead, VerifierReport
from sandbox_service.errors import BackendError, BadRequest, SandboxClosed, SandboxStateError

STATE_DIR = "/tmp/.t1jax"
TMUX_SESSION = "t1jax"
TMUX_COLUMNS, TMUX_ROWS = 160, 40
TESTS_DIR = "/tests"
VERIFIER_LOG_DIR = "/logs/verifier"
AGENT_LOG_DIR = "/logs/agent"
DEFAULT_OUTPUT_LIMIT_BYTES = 64 * 1024
# The verifier's console output is parsed (pytest's summary comes last): keep much more of it.
VERIFIER_OUTPUT_LIMIT_BYTES = 4 * 1024 * 1024
# Extra wall-clock a `run` gets beyond the command's own deadline before the caller gives up on
# the transport (the in-container watchdog should always answer first).
TRANSPORT_GRACE_SEC = 30.0


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
out="$t1/{nonce}.out"; err="$t1/{nonce}.err"; flag="$t1/{nonce}.timeout"
cd {q(workdir)} 2>/dev/null || cd /
setsid bash -c {q(command)} </dev/null >"$out" 2>"$err" 3>&- &
child=$!
echo "$child" >>"$t1/groups"
setsid bash -c 'sleep "$1"; : >"$2"; kill -KILL -- -"$3"' t1jax-watchdog {timeout_sec:.3f} "$flag" "$child" \
  </dev/null >/dev/null 2>&1 3>&- &
dog=$!
wait "$child"; rc=$?
kill -KILL -- -"$dog" "$dog"  # the pid too, in case it has not reached setsid() yet
timed=0; [ -e "$flag" ] && timed=1
osz=$(wc -c <"$out" 2>/dev/null); osz=$((osz+0))
esz=$(wc -c <"$err" 2>/dev/null); esz=$((esz+0))
t1emit() {{
  if [ "$1" -le {output_limit_bytes} ]; then head -c "$1" "$2"
  else head -c {head} "$2"; head -c "$1" "$2" | tail -c {tail}; fi
}}
t1emit "$osz" "$out"
printf '\\nT1JAX_END_{nonce} %s %s %s %s\\n' "$rc" "$timed" "$osz" "$esz"
t1emit "$esz" "$err" >&3
rm -f "$out" "$err" "$flag"
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
        raise BackendError(
            "the exec wrapper ended without its trailer (is bash/coreutils missing in the image?); "
            f"stderr: {output.stderr[-2000:].decode('utf-8', 'replace')}"
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
if ! tmux has-session -t {TMUX_SESSION} 2>/dev/null; then
  cd {q(workdir)} 2>/dev/null || cd /
  tmux start-server \\; set-option -g history-limit 50000 \\; \\
    new-session -d -s {TMUX_SESSION} -x {TMUX_COLUMNS} -y {TMUX_ROWS} || exit 97
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


def tar_directory(local_dir: Path, *, extra_files: dict[str, Path] | None = None) -> bytes:
    """An uncompressed tar of local_dir's contents (owners root, files keep their exec bits), plus
    `extra_files` (archive name -> local file) at the top level."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:

        def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            return info

        for entry in sorted(local_dir.iterdir()):
            archive.add(entry, arcname=entry.name, filter=normalize)
        for name, path in (extra_files or {}).items():
            archive.add(path, arcname=name, filter=normalize)
    return buffer.getvalue()


def put_tree_script(remote_dir: str, tar_size: int, *, replace: bool) -> bytes:
    q = shlex.quote
    clear = f"rm -rf {q(remote_dir)} && " if replace else ""
    unpack = f"head -c {tar_size} | tar -xf - -C {q(remote_dir)} --no-same-owner"
    return f"{clear}mkdir -p {q(remote_dir)} && {unpack}\n".encode()


def checksums_script(remote_dir: str, nonce: str) -> bytes:
    return (
        f"cd {shlex.quote(remote_dir)} && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum; "
        f"echo T1JAX_END_{nonce} $?\n"
    ).encode()


def local_checksums(local_dir: Path, extra_files: dict[str, Path] | None = None) -> dict[str, str]:
    """sha256 of every file that `tar_directory` ships, by its path in the archive."""
    sums: dict[str, str] = {}
    for dirpath, _, filenames in os.walk(local_dir):
        for name in filenames:
            path = Path(dirpath) / name
            sums["./" + path.relative_to(local_dir).as_posix()] = hashlib.sha256(
                path.read_bytes()
            ).hexdigest()
    for name, path in (extra_files or {}).items():
        sums["./" + name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return sums


def parse_checksums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([0-9a-f]{64})  (.*)", line)
        if match:
            sums[match.group(2)] = match.group(1)
    return sums


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


def verifier_command(task: Task) -> tuple[str, dict[str, Path]]:
    """The command that runs the task's verifier inside the container, and the files shipped to
    `/tests` besides the task's tests directory (Terminal-Bench 1.x keeps run-tests.sh outside it)."""
    if task.layout is TaskLayout.TERMINAL_BENCH_1:
        script = task.test_script if task.test_script.is_absolute() else task.source_dir / task.test_script
        return f"TEST_DIR={TESTS_DIR} bash {TESTS_DIR}/run-tests.sh", {"run-tests.sh": script}
    relative = task.test_script
    if relative.is_absolute():
        relative = relative.relative_to(task.tests_dir)
    return f"bash {shlex.quote(str(PurePosixPath(TESTS_DIR) / relative.as_posix()))}", {}


class ContainerSandbox(abc.ABC):
    """A `Sandbox` driven through `_run`; subclasses implement `_run` and `_terminate`."""

    def __init__(self, sandbox_id: str, task: Task, *, output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES):
        self._sandbox_id = sandbox_id
        self._task = task
        self.output_limit_bytes = output_limit_bytes
        self._terminal = TerminalCursor()
        self._close_lock = threading.Lock()
        self._closed = False
        self._verified = False

    # ---- what a backend provides ---------------------------------------------------------------------

    @abc.abstractmethod
    def _run(self, argv: list[str], stdin: bytes, timeout_sec: float) -> RunOutput:
        """Run argv in the container with stdin; give up after timeout_sec (finished=False)."""

    @abc.abstractmethod
    def _terminate(self) -> None:
        """Destroy the container (idempotent; may run while a `_run` is in flight)."""

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

    def _checked_run(self, script: bytes, timeout_sec: float, action: str, payload: bytes = b"") -> RunOutput:
        if self._closed:
            raise SandboxClosed(f"cannot {action}: sandbox {self._sandbox_id} is closed")
        try:
            output = self._run(bootstrap_argv(script), script + payload, timeout_sec)
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
        self, command: str, timeout_sec: float, *, output_limit_bytes: int | None = None
    ) -> ExecResult:
        """`exec` without the agent-phase check (the verifier uses it)."""
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
        output = self._checked_run(script, timeout_sec + TRANSPORT_GRACE_SEC, "exec")
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
        output = self._checked_run(script, wait_sec + TRANSPORT_GRACE_SEC, "send_keys")
        return self._terminal.consume(output, nonce, output_limit_bytes=self.output_limit_bytes)

    def verify(self) -> VerifierReport:
        """Stop the agent's processes, copy in the tests, check their checksums, run the verifier
        under the task's verifier deadline, fetch its report files and parse them."""
        if self._verified:
            raise SandboxStateError(f"verify() was already called for sandbox {self._sandbox_id}")
        self._verified = True
        task = self._task
        try:
            self._kill_agent()
            command, extra_files = verifier_command(task)
            self.put_tree(task.tests_dir, TESTS_DIR, extra_files=extra_files)
            self._checked_run(
                f"rm -rf {VERIFIER_LOG_DIR} && mkdir -p {VERIFIER_LOG_DIR}\n".encode(),
                TRANSPORT_GRACE_SEC,
                "reset logs",
            )
            expected = local_checksums(task.tests_dir, extra_files)
            found = self.remote_checksums(TESTS_DIR)
            changed = sorted(name for name, digest in expected.items() if found.get(name) != digest)
            if changed:
                return VerifierReport(
                    (),
                    False,
                    FailureCause.TESTS_TAMPERED,
                    None,
                    None,
                    detail=f"tests differ from the task's after copying them in: {', '.join(changed[:10])}",
                )
            result = self.exec_raw(
                command, task.limits.verifier_timeout_sec, output_limit_bytes=VERIFIER_OUTPUT_LIMIT_BYTES
            )
            with tempfile.TemporaryDirectory(prefix="t1jax-verifier-") as local_dir:
                for name in (reports.JUNIT_FILE, reports.CTRF_FILE, reports.REWARD_TXT, reports.REWARD_JSON):
                    data = self.read_file(f"{VERIFIER_LOG_DIR}/{name}", reports.MAX_REPORT_BYTES + 1)
                    if data is not None:
                        (Path(local_dir) / name).write_bytes(data)
                return reports.build_report(
                    report_dir=Path(local_dir),
                    output=result.stdout + result.stderr,
                    exit_code=result.exit_code,
                    timed_out=result.timed_out,
                )
        except SandboxClosed:
            raise
        except BackendError as error:
            return VerifierReport((), False, FailureCause.SANDBOX_ERROR, None, None, detail=str(error))

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._terminate()

    # ---- helpers for verify --------------------------------------------------------------------------

    def _kill_agent(self) -> None:
        self._checked_run(kill_agent_script(), TRANSPORT_GRACE_SEC, "stop the agent's processes")

    def put_tree(
        self,
        local_dir: Path,
        remote_dir: str,
        *,
        extra_files: dict[str, Path] | None = None,
        replace: bool = True,
    ) -> None:
        """Copy local_dir's contents (plus extra_files) to remote_dir via tar over exec."""
        archive = tar_directory(local_dir, extra_files=extra_files)
        script = put_tree_script(remote_dir, len(archive), replace=replace)
        nonce = secrets.token_hex(8)
        script += f"echo T1JAX_END_{nonce} $?\n".encode()
        output = self._checked_run(script, 120.0 + len(archive) / 1e6, "copy files", payload=archive)
        if f"T1JAX_END_{nonce} 0".encode() not in output.stdout:
            raise BackendError(
                f"copying {local_dir} to {remote_dir} in sandbox {self._sandbox_id} failed: "
                f"{output.stderr[-2000:].decode('utf-8', 'replace')}"
            )

    def remote_checksums(self, remote_dir: str) -> dict[str, str]:
        nonce = secrets.token_hex(8)
        output = self._checked_run(checksums_script(remote_dir, nonce), 120.0, "checksum files")
        return parse_checksums(output.stdout.decode("utf-8", "replace"))

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
