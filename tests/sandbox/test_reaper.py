"""The verifier's reaper (`_holder.py --reap-exec`): what its child sees and what it exits with,
checked against `subprocess.Popen` (restore_signals=True) from a process that ignores SIGINT, which is
what the reaper ran its child with before it stopped importing subprocess."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from sandbox_service.backends._proc import HOLDER_COMMAND

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# What a program can observe of how it was started: bash lists the ignored signals (`trap -p`),
# `yes | head -1` ends quietly only if SIGPIPE kills `yes`, and an inherited descriptor is open.
PROBE = "trap -p; yes | head -1; [ -e /proc/$$/fd/{fd} ] && echo fd-open || echo fd-closed"


def reaper(*argv: str, procs: tuple[str, ...] = (), **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*HOLDER_COMMAND, "--reap-exec", *procs, "--", *argv], capture_output=True, text=True, **kwargs
    )


def popen_reference(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    """The child as `subprocess.Popen(argv, close_fds=False)` starts it from a SIGINT-ignoring parent."""
    code = (
        "import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "sys.exit(subprocess.Popen(sys.argv[1:], close_fds=False).wait() % 256)"
    )
    argv = [sys.executable, "-I", "-S", "-c", code, *argv]
    return subprocess.run(argv, capture_output=True, text=True, **kwargs)


def test_the_child_starts_with_the_signals_and_descriptors_popen_gave_it():
    read, write = os.pipe()
    probe = PROBE.format(fd=write)
    try:
        ours = reaper("bash", "-c", probe, pass_fds=(write,))
        reference = popen_reference("bash", "-c", probe, pass_fds=(write,))
    finally:
        os.close(read)
        os.close(write)
    assert ours.returncode == reference.returncode == 0
    assert ours.stdout == reference.stdout
    assert "SIGINT" in ours.stdout and "SIGPIPE" not in ours.stdout  # INT ignored, PIPE default
    assert "fd-open" in ours.stdout  # inherited descriptors reach the child (bwrap's --userns FD)
    assert "Broken pipe" not in ours.stderr


@pytest.mark.parametrize(
    "script, expected",
    [
        ("exit 3", 3),
        ("exit 0", 0),
        ("kill -TERM $$", 128 + signal.SIGTERM),
        ("kill -KILL $$", 128 + signal.SIGKILL),
    ],
)
def test_exit_status_is_the_childs_and_a_signal_is_128_plus_its_number(script, expected):
    assert reaper("sh", "-c", script).returncode == expected


def test_orphans_of_the_child_are_waited_for():
    # The child exits at once, leaving a grandchild that writes after a moment: the reaper (a
    # subreaper) returns only once the orphan is gone, so its output is complete.
    result = reaper("sh", "-c", "(sleep 0.3; echo late) & exit 0")
    assert result.returncode == 0 and result.stdout == "late\n"


def test_a_program_that_cannot_run_and_a_cgroup_it_cannot_join_are_one_line_each(tmp_path):
    missing = reaper(str(tmp_path / "no-such-program"))
    assert missing.returncode == 127
    assert missing.stderr.count("\n") == 1 and "cannot run" in missing.stderr
    unjoinable = reaper("true", procs=(str(tmp_path / "no-cgroup" / "cgroup.procs"),))
    assert unjoinable.returncode == 125
    assert unjoinable.stderr.count("\n") == 1 and "cgroups" in unjoinable.stderr


def test_the_child_joins_the_listed_procs_files_before_it_runs(tmp_path):
    # A plain file stands in for a cgroup.procs file: what the child wrote there is its own pid,
    # which the program it became (exec keeps the pid) prints as $$.
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    result = reaper("sh", "-c", "echo $$", procs=(str(procs),))
    assert result.returncode == 0
    assert procs.read_text() == result.stdout.strip()


def test_the_reaper_imports_no_more_than_it_needs():
    # The point of its lean imports (~25 ms of CPU a verification): a whole `--reap-exec` run, as
    # the script's main, loads none of the holder's modules.
    code = (
        "import runpy, sys; sys.argv = [sys.argv[1], '--reap-exec', '--', 'true']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as end:\n"
        "    assert end.code == 0, end.code\n"
        "print(sorted({'subprocess', 'json', 'shutil', 'select', 'signal'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, HOLDER_COMMAND[-1]], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
