"""A task's reference solution as shell command lines, for `check-tasks` and for an oracle agent.

This module owns `solution_commands(task)`: the lines that, typed one by one into the sandbox's
shell (a tmux terminal or separate `exec` calls, any backend), install the task's reference
solution where the task expects it and run it from the task's working directory, as Harbor's
oracle does: the Harbor `solution/` directory becomes `/solution` (its `solve.sh` may refer to
`/solution/...`), a Terminal-Bench 1.x `solution.sh` becomes `/solution/solution.sh`.

How: the solution is packed as a gzip tar, base64-encoded, and appended in chunks of at most
`CHUNK_CHARS` characters to `/tmp/.t1jax-solution.b64` (one `printf` per line); the last line
unpacks it into `/solution` (or, where the image's user cannot create `/solution`, into
`$TMPDIR/solution`, and says so on stderr), removes the archive, and runs the entry script with
bash from the workdir, with `[solution].env` exported. Every line is a complete shell command that
needs nothing from the lines before except the archive file, so it works whether the lines share
one shell (tmux) or not (exec); only bash, coreutils (base64) and tar are needed in the image.

Invariants:
- Every line is shorter than `MAX_LINE_CHARS` and contains no newline and no non-ASCII character.
- Running the lines in order leaves the solution's files, byte for byte and with their modes,
  under the solution directory, and runs its entry script last; the result of the last line is
  the result of the solution.
"""

from __future__ import annotations

import base64
import gzip
import io
import re
import shlex
import tarfile
from pathlib import Path

from sandbox_service.contracts import Task, TaskLayout

CHUNK_CHARS = 900
MAX_LINE_CHARS = 1200
ARCHIVE = "/tmp/.t1jax-solution.b64"
SOLUTION_DIR = "/solution"

# Commands in a solution that reach the internet (the same families the verifier's rule knows).
_NETWORK_COMMAND = re.compile(
    r"(?<![\w.-])(curl|wget|uvx?|apt-get|apt|conda|mamba|micromamba|npx|yarn|pipx)(?![\w.-])"
    r"|\bnpm\s+(?:install|i|ci)\b|\bpip3?\s+install\b|\bpython3?\s+-m\s+pip\s+install\b|\bgit\s+clone\b"
    r"|\bgo\s+(?:get|install|mod\s+download)\b|\bcargo\s+(?:install|fetch)\b"
)


def solution_source(task: Task) -> tuple[Path, str] | None:
    """(what to pack, the entry script's name inside the solution directory), or None."""
    if task.solution_script is None:
        return None
    if task.layout == TaskLayout.HARBOR:
        return task.solution_script.parent, task.solution_script.name
    return task.solution_script, task.solution_script.name


def solution_commands(task: Task, *, workdir: str | None = None) -> list[str]:
    """Shell lines that install and run `task`'s reference solution (see the module docstring).

    `workdir` overrides where the entry script runs (default: the task's workdir when task.toml or
    the Dockerfile names one, else wherever the sandbox's shell starts, which is the image's
    WORKDIR). Raises ValueError for a task without a reference solution."""
    source = solution_source(task)
    if source is None:
        raise ValueError(f"task {task.task_id!r} has no reference solution")
    path, entry = source
    lines = archive_lines(path, ARCHIVE)
    exports = "".join(
        f"export {key}={shlex.quote(value)}; " for key, value in sorted(task.solution_env.items())
    )
    if workdir is None and task.environment.workdir_from != "default":
        workdir = task.environment.workdir
    cd = f"cd {shlex.quote(workdir)} && " if workdir else ""  # else: where the sandbox's shell starts
    lines.append(
        f"d={SOLUTION_DIR}; {{ mkdir -p $d && [ -w $d ]; }} 2>/dev/null || "
        f'{{ d=${{TMPDIR:-/tmp}}/solution; echo "[t1jax] {SOLUTION_DIR} is not writable; using $d" >&2; }}; '
        f"mkdir -p $d && base64 -d {ARCHIVE} | tar -xzf - -C $d --no-same-owner && rm -f {ARCHIVE} && "
        f"{cd}{exports}bash $d/{shlex.quote(entry)}"
    )
    for line in lines:
        if len(line) >= MAX_LINE_CHARS or "\n" in line or not line.isascii():
            raise ValueError(
                f"task {task.task_id!r}: a solution command line is unusable ({len(line)} chars)"
            )
    return lines


def archive_lines(source: Path, archive: str) -> list[str]:
    """Lines that write `source` (a directory's contents, or one file) as a base64 gzip tar to the
    file `archive` in the sandbox, `CHUNK_CHARS` characters a line (`base64 -d archive | tar -xz`
    unpacks it)."""
    encoded = base64.b64encode(_tar_gz(source)).decode("ascii")
    lines = [f"rm -f {archive}"]
    lines += [
        f"printf %s {encoded[i : i + CHUNK_CHARS]} >> {archive}" for i in range(0, len(encoded), CHUNK_CHARS)
    ]
    return lines


def solution_network_use(task: Task) -> str | None:
    """The first command of the task's solution scripts that needs the internet, if any."""
    source = solution_source(task)
    if source is None:
        return None
    path, _ = source
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if file.suffix not in ("", ".sh", ".bash", ".py"):
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        code = "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines())
        match = _NETWORK_COMMAND.search(code)
        if match:
            return match.group(0).strip()
    return None


def _tar_gz(source: Path) -> bytes:
    """A deterministic gzip tar of `source` (a directory's contents, or one file)."""
    buffer = io.BytesIO()
    compressed = gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=9, mtime=0)

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mtime = 0
        return info

    with compressed, tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as archive:
        if source.is_dir():
            for path in sorted(source.rglob("*")):
                archive.add(path, arcname=str(path.relative_to(source)), recursive=False, filter=normalize)
        else:
            archive.add(source, arcname=source.name, filter=normalize)
    return buffer.getvalue()
