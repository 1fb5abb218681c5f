"""Mount-namespace keeper and reaper: the root-side parent of a sandbox's (or a build's) processes.

Run as `unshare --mount --propagation private -- python -I -S _holder.py CONFIG_JSON` by the local
backend and the environment builder. It performs the listed filesystem operations in its private
mount namespace, optionally spawns one child (the sandbox's init `bwrap`) into given cgroups under an
unprivileged uid (with `pid_namespace`, as the init of a new pid namespace with its own /proc: the
sandbox's pid namespace is then that one's child, and the verifier joins that one), prints one
JSON line (`{"ok": true, "pid": ..., "child": {...}}` or `{"ok": false, "error": ...}`; the child's
pid is always its host pid) and then waits until its stdin reaches EOF.

`python -I -S _holder.py --reap-exec [--own-proc] PROCS... -- ARGV...` is the short-lived variant
used for the verifier (`--own-proc`: run in a pid namespace entered with setns, it gives itself a
private mount namespace whose /proc is that pid namespace's, and when ARGV exits it kills what the
verifier left in that namespace, never a process of a child namespace: the agent's): it runs ARGV
(joined to the cgroups whose `cgroup.procs` files are PROCS) with inherited stdio and file
descriptors, SIGINT ignored and the other signals as a fresh process has them, and
exits with its status. It runs once per verification, so it imports only `os`, `sys`, `ctypes` and
the builtin `_signal`: the holder's own modules (json, subprocess, shutil, select, signal's enums)
are imported where the holder uses them, which took ~25 ms of CPU off every verification (a
verification is ~0.27 CPU s, most of it the task's pytest).

The `userns` op makes a user namespace mapping `count` ids from host id `base` (uid and gid 0 inside
is host `base`), owned by `base`, and keeps it alive with a child that waits for the holder to end;
the reply's `userns` names that child's pid, so `/proc/<pid>/ns/user` can be handed to bwrap's
`--userns`. (bwrap itself can map only one id; a sandbox needs the whole range for normal uids.)

Both are child subreapers: bwrap's in-sandbox init outlives bwrap's outer process, so without a
subreaper it would become a zombie of the host's pid 1, which may never reap it.

Invariants:
- Nothing it mounts is visible outside its mount namespace, so every mount disappears when the
  namespace's last process exits: a crashed service leaks no mounts.
- It lives exactly as long as its stdin is open: the service closing the pipe (or dying) makes it
  SIGKILL its child and exit. The child runs `bwrap --die-with-parent`, so it dies with the holder.
- Standard library only, single-threaded: `preexec_fn` (cgroup join + setuid) is safe here.
"""

from __future__ import annotations

import _signal  # the interpreter's builtin signal module: `signal` adds ~6 ms of enum imports
import ctypes
import os
import sys

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (the reaper pays for it)
if TYPE_CHECKING:
    import subprocess

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    encode = lambda s: None if s is None else s.encode()
    if _libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or 'bind'} {source} -> {target} ({data}): {os.strerror(errno)}")


def _become_subreaper() -> None:
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _reap_exited() -> None:
    """Collect every exited child (including orphans handed to us as subreaper) without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _join_cgroups(procs_files) -> None:
    for procs in procs_files:
        with open(procs, "w") as handle:
            handle.write(str(os.getpid()))


def _chown_tree(path: str, uid: int, gid: int) -> None:
    os.lchown(path, uid, gid)
    for directory, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(directory, name), uid, gid)


def _make_userns(base: int, count: int) -> int:
    """Fork a child that owns a new user namespace mapping [0, count) to [base, base + count) and
    stays until this process exits; return its pid."""
    ready_read, ready_write = os.pipe()
    hold_read, hold_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the keeper: no Python beyond these calls
        try:
            os.close(ready_read)
            os.close(hold_write)
            os.setresgid(base, base, base)
            os.setresuid(base, base, base)
            if _libc.unshare(CLONE_NEWUSER) != 0:
                os._exit(3)
            os.write(ready_write, b"x")
            os.read(hold_read, 1)  # EOF when the holder is gone
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(hold_read)
    if os.read(ready_read, 1) != b"x":
        raise OSError("the user-namespace keeper could not unshare its user namespace")
    os.close(ready_read)
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as handle:
            handle.write(f"0 {base} {count}\n")
    _KEEPERS.append(hold_write)  # kept open (not inheritable) for the holder's lifetime
    return pid


_KEEPERS: list[int] = []
_USERNS: dict[str, int] = {}


def _apply(op: dict) -> None:
    kind = op["op"]
    if kind == "userns":
        _USERNS[op["name"]] = _make_userns(op["base"], op["count"])
        return
    if kind == "mkdir":
        path = op["path"]
        if op.get("exist_ok") and os.path.isdir(path):
            return  # keep what the environment has there
        created, parent = [], path
        while not os.path.lexists(parent):
            created.append(parent)
            parent = os.path.dirname(parent)
        os.makedirs(path, exist_ok=True)
        os.chmod(path, op.get("mode", 0o755))
        for directory in created or [path]:  # every directory it made gets the owner
            os.lchown(directory, op.get("uid", 0), op.get("gid", 0))
    elif kind == "file":
        with open(op["path"], "w") as handle:
            handle.write(op.get("content", ""))
        os.chmod(op["path"], op.get("mode", 0o444))
    elif kind == "mount":
        flags = MS_NOSUID | MS_NODEV if op.get("nosuid", True) else 0
        if op.get("readonly"):
            flags |= MS_RDONLY
        _mount(op["source"], op["target"], op["fstype"], flags, op.get("options"))
    elif kind == "bind":
        _mount(op["source"], op["target"], None, MS_BIND | (MS_REC if op.get("recursive") else 0), None)
        if op.get("readonly"):
            _mount(None, op["target"], None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    elif kind == "copy":  # the contents of a host directory into a target directory, then chown
        import shutil

        source, target = op["source"], op["target"]
        for name in os.listdir(source):
            src, dst = os.path.join(source, name), os.path.join(target, name)
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.copy2(src, dst, follow_symlinks=False)
        if "uid" in op:
            _chown_tree(target, op["uid"], op["gid"])
    else:
        raise ValueError(f"unknown holder op {kind!r}")


def _spawn(spec: dict) -> tuple[subprocess.Popen, dict]:
    """Start the child; return it with bwrap's info JSON once the child reported ready.

    bwrap writes its info (`child-pid`) before it has finished mounting the sandbox, so the child's
    command must also write a line to `{ready_fd}` when it runs: only then is the sandbox complete.
    """
    import json
    import subprocess

    info_read, info_write = os.pipe()
    ready_read, ready_write = os.pipe()
    pass_fds = [info_write, ready_write]
    userns_fd = None
    if spec.get("userns"):
        userns_fd = os.open(f"/proc/{_USERNS[spec['userns']]}/ns/user", os.O_RDONLY)
        pass_fds.append(userns_fd)
    argv = [
        arg.replace("{info_fd}", str(info_write))
        .replace("{ready_fd}", str(ready_write))
        .replace("{userns_fd}", str(userns_fd))
        for arg in spec["argv"]
    ]
    uid, gid = spec.get("uid"), spec.get("gid")

    def enter_cgroups_and_drop_privileges() -> None:
        _join_cgroups(spec.get("cgroup_procs", []))
        if spec.get("pid_namespace"):  # the first process of the new pid namespace: its init
            _mount_own_proc()
        if gid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
        if uid is not None:
            os.setresuid(uid, uid, uid)

    if spec.get("pid_namespace") and _libc.unshare(CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWPID) failed")
    child = subprocess.Popen(
        argv,
        env=spec.get("env", {}),
        cwd=spec.get("cwd", "/"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        preexec_fn=enter_cgroups_and_drop_privileges,
    )
    os.close(info_write)
    os.close(ready_write)
    if userns_fd is not None:
        os.close(userns_fd)
    with os.fdopen(info_read, "rb") as info:
        raw = info.read()  # bwrap closes the info fd after writing it (or exits on failure)
    with os.fdopen(ready_read, "rb") as ready:
        ready_line = ready.readline()  # EOF (b"") if the sandbox died before its command ran
    try:
        info_json = json.loads(raw.decode() or "null") or {}
    except json.JSONDecodeError:
        info_json = {}
    if ready_line.strip() != b"ready":
        info_json.pop("child-pid", None)
    elif "child-pid" in info_json:
        if spec.get("pid_namespace"):  # bwrap names it in its own namespace: find its host pid
            info_json["child-pid"] = _only_child(child.pid)
        info_json["start-time"] = _start_time(info_json["child-pid"])
    return child, info_json


def _only_child(parent: int) -> int | None:
    """The host pid of `parent`'s one child (bwrap's outer process has exactly one: the init)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    if int(handle.read().rsplit(b")", 1)[1].split()[1]) == parent:
                        return int(entry)
            except (OSError, IndexError, ValueError):
                continue
    return None


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _kill_sandbox(spec: dict, child: subprocess.Popen | None, child_info: dict) -> None:
    """SIGKILL the sandbox's pid-namespace init (the kernel then kills the whole namespace), bwrap
    itself, and anything left in its cgroups: bwrap's --die-with-parent alone does not reach a
    namespace init whose credentials changed."""
    import time

    init_pid = child_info.get("child-pid")
    if init_pid and _start_time(init_pid) == child_info.get("start-time"):  # not a reused pid
        os.kill(init_pid, _signal.SIGKILL)
    if child is not None and child.poll() is None:
        child.kill()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        members = set()
        for procs in spec.get("cgroup_procs", []):
            try:
                with open(procs) as handle:
                    members.update(int(line) for line in handle.read().split())
            except OSError:
                continue
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_exited()
        time.sleep(0.01)
    if child is not None:
        child.wait()


def reap_exec(args: list[str]) -> int:
    own_proc = args[:1] == ["--own-proc"]
    args = args[1:] if own_proc else args
    separator = args.index("--")
    procs_files, argv = args[:separator], args[separator + 1 :]
    _become_subreaper()
    if own_proc:
        _mount_own_proc()
    pid = os.fork()
    if pid == 0:  # the child never returns into the reaper's code, whatever happens
        try:
            _become(procs_files, argv)
        finally:
            os._exit(127)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if own_proc:
        _end_namespace_peers()
    while True:  # orphans of the child (its namespace's init) are ours now
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    return status if status >= 0 else 128 - status


def _mount_own_proc() -> None:
    """A mount namespace of this process's own (a private copy of the current one) whose /proc is a
    procfs of this process's pid namespace: bwrap, run in a pid namespace entered with setns, reads
    /proc/PID of its child by the pid it has there, and the verifier is shown this /proc."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _end_namespace_peers() -> None:
    """SIGKILL what the verifier left in this pid namespace (whose procfs is /proc): every process
    whose namespace is this one, except its init and this reaper. Processes of child namespaces
    (the agent's) are not ours."""
    me = str(os.getpid())
    try:
        own = os.readlink("/proc/self/ns/pid")
    except OSError:
        return
    for _ in range(200):
        peers = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or entry in ("1", me):
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == own:
                    peers.append(int(entry))
            except OSError:
                continue
        if not peers:
            return
        for peer in peers:
            try:
                os.kill(peer, _signal.SIGKILL)
            except OSError:
                pass
        _reap_exited()


def _become(procs_files: list[str], argv: list[str]) -> None:
    """In the reaper's child: what `subprocess.Popen(argv, preexec_fn=join, close_fds=False)` did,
    without importing subprocess. Exits 125 when a cgroup cannot be joined; returns (the caller
    exits 127) when `argv` cannot be executed."""
    for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):  # Python ignores these; a program expects them
        if hasattr(_signal, name):
            _signal.signal(getattr(_signal, name), _signal.SIG_DFL)
    try:
        _join_cgroups(procs_files)
    except OSError as error:
        os.write(2, f"reap-exec: cannot join the sandbox's cgroups: {error}\n".encode())
        os._exit(125)
    try:
        os.execvp(argv[0], argv)
    except OSError as error:
        os.write(2, f"reap-exec: cannot run {argv[0]}: {error}\n".encode())


def main() -> int:
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # a Ctrl-C to the service's group must not orphan mounts
    if sys.argv[1] == "--reap-exec":
        return reap_exec(sys.argv[2:])
    import json
    import select
    import time

    _become_subreaper()
    config = json.loads(sys.argv[1])
    child = None
    child_info: dict = {}
    try:
        for op in config.get("ops", []):
            _apply(op)
        if config.get("spawn"):
            child, child_info = _spawn(config["spawn"])
            if "child-pid" not in child_info:
                child.wait(timeout=10)
                error = child.stderr.read().decode(errors="replace").strip() if child.stderr else ""
                raise RuntimeError(f"bwrap failed to start (exit {child.returncode}): {error}")
        print(
            json.dumps({"ok": True, "pid": os.getpid(), "child": child_info, "userns": _USERNS}), flush=True
        )
    except Exception as error:  # reported to the service, which raises it with context
        print(json.dumps({"ok": False, "error": f"{type(error).__name__}: {error}"}), flush=True)
        if child is not None and child.poll() is None:
            child.kill()
        return 1
    stdin = sys.stdin.buffer.raw
    while True:  # until the service closes our stdin (or dies), reaping orphans as they come
        readable, _, _ = select.select([stdin], [], [], 0.2)
        _reap_exited()
        if readable and not stdin.read(4096):
            break
    _kill_sandbox(config.get("spawn") or {}, child, child_info)
    for hold in _KEEPERS:  # the user-namespace keepers see EOF and exit
        os.close(hold)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.01)
        except ChildProcessError:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
