"""The step library of the synthetic task suite: idioms a terminal agent uses, as task steps.

An `Idiom` makes `Step`s: one numbered sentence of a task's instruction, the environment files it
needs, the commands that do it (each command is one agent turn), the checks that verify it (each
check is one separately reported pytest assertion), and the plausible-but-wrong variants a
demonstrator may use instead (`Mistake`s: a missing `-i`, `mkdir -p` or `chmod +x`, `wc -l f`
for `wc -l < f`...), every one of which some check catches.

Inspection steps (`Step.inspect`) name a file or value only indirectly ("the one file in
/app/inbox", "the value of port in /app/x.ini"): the agent must read the environment first and
use what it printed; the reference solution knows the value, the demonstrator runs the inspection
command and then acts on what it showed. A directory is listed with `ls -d DIR/*`, which prints
full paths: the command then repeats the printed path's tokens (`/report` after `/inbox`), which a
small model copies as it copies paths from the instruction; a bare `ls DIR` prints `report.txt`,
whose word is a third token (neither ` report` nor `/report`), and the demo's SFT policy never
learnt to map it (measured: `output.sh` listed, `sh /app/input/user.sh` run).

Slot values are words of `SLOT_WORDS`: 16 words, each a single token of the project BPE both
after a space and after a slash (`/report`, ` report`), so copying a name is copying one token
out of a small set; numbers are single digits or two. This is a deliberate lever for tiny models
(short slot values from a small vocabulary: a 0.5M-parameter model learns to copy 8-16 distinct
tokens within a few hundred steps, and not 96 within thousands), not an accident. Names of
files and directories directly under /app are unique within a task (`Slots.top`); other values
(file names inside a step's own directory, keys, contents, branch names) are unique within a
step (`Slots.word`).

Invariants (checked by `tests/data_gen`): a step's checks pass after its `inspect + actions`
and at least one fails when nothing was done; every mistake fails at least one check (most pass
some too, so the test-count reward stays partial); a step writes only paths named by its own slot
words (and /root/.bashrc, used by one idiom only), so the steps of one task never collide.
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

# Single tokens of the project BPE after ' ' and after '/' (measured on t1jax-bpe-2048.json),
# valid Python identifiers, none a substring of another.
SLOT_WORDS = (
    "backup build cache config data index input model output queue report server table token user value"
).split()

CATEGORIES = (
    "scripting",
    "software-development",
    "system-administration",
    "environment-setup",
    "version-control",
    "data-processing",
    "debugging",
    "file-operations",
)


@dataclass(frozen=True)
class EnvFile:
    """A file the task's environment starts with (absolute container path, text, mode)."""

    path: str
    content: str
    mode: int = 0o644


@dataclass(frozen=True)
class Check:
    """One pytest assertion: `body` is Python statements run inside `def test_<name>():`."""

    name: str
    body: str


@dataclass(frozen=True)
class Mistake:
    """A plausible-but-wrong way to do a step: `actions` replaces the step's own actions."""

    name: str
    actions: tuple[str, ...]


@dataclass(frozen=True)
class Step:
    """One numbered instruction sentence and everything needed to set it up, do it and check it.

    `inspect` commands read the environment (the agent must run them to learn a name or value the
    sentence does not give); `actions` change it. Every command is one agent turn, so
    `required_steps = len(inspect) + len(actions)` is the step's share of a task's difficulty.
    `build` holds shell commands for the Dockerfile's RUN lines (e.g. creating a git repository).
    """

    idiom: str
    category: str
    sentence: str
    checks: tuple[Check, ...]
    actions: tuple[str, ...]
    inspect: tuple[str, ...] = ()
    files: tuple[EnvFile, ...] = ()
    build: tuple[str, ...] = ()
    mistakes: tuple[Mistake, ...] = ()

    @property
    def required_steps(self) -> int:
        return len(self.inspect) + len(self.actions)


class Slots:
    """Fresh slot values for one task. `top` names (files and directories directly under /app)
    never repeat within the task, so steps cannot touch each other's files; `word` values never
    repeat within a step (`begin_step` starts a new one)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self._top: set[str] = set()
        self._step: set[str] = set()

    def begin_step(self) -> None:
        self._step = set()

    def top(self) -> str:
        word = self.rng.choice([w for w in SLOT_WORDS if w not in self._top and w not in self._step])
        self._top.add(word)
        self._step.add(word)
        return word

    def word(self) -> str:
        word = self.rng.choice([w for w in SLOT_WORDS if w not in self._step])
        self._step.add(word)
        return word

    def words(self, count: int) -> list[str]:
        return [self.word() for _ in range(count)]

    def number(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)


@dataclass(frozen=True)
class Idiom:
    """A kind of step. `mistake_rate` is how often the demonstrator uses one of its mistakes."""

    name: str
    category: str
    make: Callable[[Slots], Step] = field(repr=False)
    mistake_rate: float = 0.0


def _lines(items) -> str:
    return "".join(f"{item}\n" for item in items)


def _printf(text: str) -> str:
    """A shell word that printf turns back into `text` (newlines as \\n, no other escapes)."""
    return shlex.quote(text.replace("\\", "\\\\").replace("%", "%%").replace("\n", "\\n"))


def _read(path: str) -> str:
    return f"Path({path!r}).read_text()"


def _exists(path: str) -> Check:
    return Check("exists", f"assert Path({path!r}).exists()")


def _module(path: str) -> str:
    """Python expression that imports the module file at `path` under a private name."""
    return f"load_module({path!r})"


# ------------------------------------------------------------------------------------------------
# scripting


def script_echo(s: Slots) -> Step:
    name, word = s.top(), s.word()
    path = f"/app/{name}.sh"
    script = f"#!/bin/sh\necho {word}\n"
    return Step(
        "script_echo",
        "scripting",
        f"Write a shell script {path} that prints {word}, and make it executable.",
        checks=(
            _exists(path),
            Check("executable", f"assert os.access({path!r}, os.X_OK)"),
            Check("prints", f"assert run('sh', {path!r}).stdout.strip() == {word!r}"),
        ),
        actions=(f"printf {_printf(script)} > {path} && chmod +x {path}",),
        mistakes=(Mistake("no-chmod", (f"printf {_printf(script)} > {path}",)),),
    )


def script_count_arg(s: Slots) -> Step:
    name, sample = s.top(), s.top()
    path, sample_path = f"/app/{name}.sh", f"/app/{sample}.txt"
    count = s.number(3, 9)
    script = '#!/bin/sh\nwc -l < "$1"\n'
    wrong = '#!/bin/sh\nwc -l "$1"\n'
    return Step(
        "script_count_arg",
        "scripting",
        f"Write an executable shell script {path} that prints the number of lines of the file "
        f"given as its first argument.",
        files=(EnvFile(sample_path, _lines(f"line {i}" for i in range(count))),),
        checks=(
            Check("executable", f"assert os.access({path!r}, os.X_OK)"),
            Check("counts", f"assert run({path!r}, {sample_path!r}).stdout.strip() == {str(count)!r}"),
        ),
        actions=(f"printf {_printf(script)} > {path} && chmod +x {path}",),
        mistakes=(
            Mistake("wc-prints-name", (f"printf {_printf(wrong)} > {path} && chmod +x {path}",)),
            Mistake("no-chmod", (f"printf {_printf(script)} > {path}",)),
        ),
    )


def make_files(s: Slots) -> Step:
    directory, names = s.top(), s.words(3)
    root = f"/app/{directory}"
    paths = [f"{root}/{n}.txt" for n in names]
    listed = ", ".join(f"{n}.txt" for n in names[:-1]) + f" and {names[-1]}.txt"
    return Step(
        "make_files",
        "scripting",
        f"Create the empty files {listed} in a new directory {root}.",
        checks=(
            Check("directory", f"assert Path({root!r}).is_dir()"),
            Check("files", f"assert all(Path(p).is_file() for p in {paths!r})"),
        ),
        actions=(f"mkdir -p {root} && touch {' '.join(paths)}",),
        mistakes=(Mistake("no-mkdir", (f"touch {' '.join(paths)}",)),),
    )


def run_only_script(s: Slots) -> Step:
    directory, out, script, word = s.top(), s.top(), s.word(), s.word()
    root, out_path = f"/app/{directory}", f"/app/{out}.txt"
    path = f"{root}/{script}.sh"
    return Step(
        "run_only_script",
        "scripting",
        f"Run the only script in {root} and save what it prints to {out_path}.",
        files=(EnvFile(path, f"#!/bin/sh\necho {word}\n"),),
        inspect=(f"ls -d {root}/*",),
        checks=(_exists(out_path), Check("output", f"assert {_read(out_path)}.strip() == {word!r}")),
        actions=(f"sh {path} > {out_path}",),
        mistakes=(Mistake("not-executable", (f"{path} > {out_path}",)),),
    )


# ------------------------------------------------------------------------------------------------
# software development


def _two_functions(fixed: str, other: str, body: str) -> str:
    return f"def {fixed}(a, b):\n    return {body}\n\n\ndef {other}(a, b):\n    return a * b\n"


def fix_operator(s: Slots) -> Step:
    module, fixed, other = s.top(), s.word(), s.word()
    path = f"/app/{module}.py"
    return Step(
        "fix_operator",
        "software-development",
        f"The function {fixed} in {path} should return a + b but returns a - b. Fix it.",
        files=(EnvFile(path, _two_functions(fixed, other, "a - b")),),
        checks=(
            Check("fixed", f"assert {_module(path)}.{fixed}(5, 3) == 8"),
            Check("other_kept", f"assert {_module(path)}.{other}(5, 3) == 15"),
        ),
        actions=(f"sed -i 's/a - b/a + b/' {path}",),
        mistakes=(Mistake("sed-without-i", (f"sed 's/a - b/a + b/' {path}",)),),
    )


def append_function(s: Slots) -> Step:
    module, existing, new = s.top(), s.word(), s.word()
    path = f"/app/{module}.py"
    value = s.number(2, 9)
    code = f"def {new}():\n    return {value}\n"
    return Step(
        "append_function",
        "software-development",
        f"Append a function {new}() that returns {value} to {path}, keeping the code already there.",
        files=(EnvFile(path, f"def {existing}():\n    return 1\n\n\n"),),
        checks=(
            Check("new_function", f"assert {_module(path)}.{new}() == {value}"),
            Check("existing_kept", f"assert {_module(path)}.{existing}() == 1"),
        ),
        actions=(f"printf {_printf(code)} >> {path}",),
        mistakes=(Mistake("overwrite", (f"printf {_printf(code)} > {path}",)),),
    )


def rename_function(s: Slots) -> Step:
    module, old, new = s.top(), s.word(), s.word()
    path = f"/app/{module}.py"
    code = f"def {old}(x):\n    return x + 1\n\n\ndef total():\n    return {old}(1) + {old}(2)\n"
    return Step(
        "rename_function",
        "software-development",
        f"Rename the function {old} to {new} everywhere in {path}.",
        files=(EnvFile(path, code),),
        checks=(
            Check("renamed", f"assert {_module(path)}.{new}(1) == 2"),
            Check("old_name_gone", f"assert {old!r} not in {_read(path)}"),
            Check("still_runs", f"assert {_module(path)}.total() == 5"),
        ),
        actions=(f"sed -i 's/{old}/{new}/g' {path}",),
        mistakes=(Mistake("sed-without-g", (f"sed -i 's/{old}/{new}/' {path}",)),),
    )


# ------------------------------------------------------------------------------------------------
# system administration


def private_key(s: Slots) -> Step:
    name = s.top()
    path = f"/app/{name}.key"
    secret = s.word()
    return Step(
        "private_key",
        "system-administration",
        f"Make {path} readable and writable by its owner only.",
        files=(EnvFile(path, f"{secret}\n"),),
        checks=(
            Check("mode", f"assert stat.S_IMODE(os.stat({path!r}).st_mode) == 0o600"),
            Check("content_kept", f"assert {_read(path)} == {secret + chr(10)!r}"),
        ),
        actions=(f"chmod 600 {path}",),
        mistakes=(Mistake("group-readable", (f"chmod 640 {path}",)),),
    )


def symlink(s: Slots) -> Step:
    target, link = s.top(), s.top()
    target_path, link_path = f"/app/{target}.txt", f"/app/{link}"
    text = f"{s.word()}\n"
    return Step(
        "symlink",
        "system-administration",
        f"Create a symbolic link {link_path} that points to {target_path}.",
        files=(EnvFile(target_path, text),),
        checks=(
            Check("is_symlink", f"assert Path({link_path!r}).is_symlink()"),
            Check("resolves", f"assert {_read(link_path)} == {text!r}"),
        ),
        actions=(f"ln -s {target_path} {link_path}",),
        mistakes=(Mistake("hard-link", (f"ln {target_path} {link_path}",)),),
    )


def cron_line(s: Slots) -> Step:
    table, job, old_job = s.top(), s.word(), s.word()
    path = f"/app/{table}.cron"
    hour = s.number(1, 9)
    existing = f"30 5 * * * /app/{old_job}.sh"
    line = f"0 {hour} * * * /app/{job}.sh"
    return Step(
        "cron_line",
        "system-administration",
        f"Add a line to the crontab {path} that runs /app/{job}.sh every day at {hour}:00, "
        f"keeping the line already there.",
        files=(EnvFile(path, existing + "\n"),),
        checks=(
            Check("line_added", f"assert {line!r} in {_read(path)}.splitlines()"),
            Check("existing_kept", f"assert {existing!r} in {_read(path)}.splitlines()"),
        ),
        actions=(f"echo '{line}' >> {path}",),
        mistakes=(Mistake("fields-swapped", (f"echo '{hour} 0 * * * /app/{job}.sh' >> {path}",)),),
    )


def clean_logs(s: Slots) -> Step:
    directory, names = s.top(), s.words(3)
    root = f"/app/{directory}"
    logs = [f"{root}/{n}.log" for n in names[:2]]
    kept = f"{root}/{names[2]}.txt"
    return Step(
        "clean_logs",
        "system-administration",
        f"Delete the files ending in .log from {root} and keep the other files.",
        files=tuple(EnvFile(p, "old\n") for p in [*logs, kept]),
        checks=(
            Check("logs_gone", f"assert not any(Path(p).exists() for p in {logs!r})"),
            Check("others_kept", f"assert Path({kept!r}).is_file()"),
        ),
        actions=(f"rm {root}/*.log",),
        mistakes=(Mistake("deletes-everything", (f"rm {root}/*",)),),
    )


def owner_home(s: Slots) -> Step:
    config, homes, user, group = s.top(), s.top(), s.word(), s.word()
    path = f"/app/{config}.conf"
    home = f"/app/{homes}/{user}"
    return Step(
        "owner_home",
        "system-administration",
        f"The owner line of {path} names a user. Create the directory /app/{homes}/<that user>.",
        files=(EnvFile(path, f"group = {group}\nowner = {user}\n"),),
        inspect=(f"cat {path}",),
        checks=(
            Check("home", f"assert Path({home!r}).is_dir()"),
            Check("only_home", f"assert os.listdir('/app/{homes}') == [{user!r}]"),
        ),
        actions=(f"mkdir -p {home}",),
        mistakes=(Mistake("no-parents", (f"mkdir {home}",)),),
    )


# ------------------------------------------------------------------------------------------------
# environment setup


def pin_requirement(s: Slots) -> Step:
    name, package, other = s.top(), s.word(), s.word()
    path = f"/app/{name}.txt"
    major, minor = s.number(1, 9), s.number(0, 9)
    existing = f"{other}==1.0"
    pin = f"{package}=={major}.{minor}"
    return Step(
        "pin_requirement",
        "environment-setup",
        f"Add {package} pinned to version {major}.{minor} to the requirements file {path}, keeping "
        f"what it lists.",
        files=(EnvFile(path, existing + "\n"),),
        checks=(
            Check("pinned", f"assert {pin!r} in {_read(path)}.split()"),
            Check("existing_kept", f"assert {existing!r} in {_read(path)}.split()"),
        ),
        actions=(f"echo '{pin}' >> {path}",),
        mistakes=(Mistake("single-equals", (f"echo '{package}={major}.{minor}' >> {path}",)),),
    )


def ini_set(s: Slots) -> Step:
    name, (key, old, new, other_key, other_value) = s.top(), s.words(5)
    path = f"/app/{name}.ini"
    return Step(
        "ini_set",
        "environment-setup",
        f"In {path}, change the value of {key} from {old} to {new}.",
        files=(EnvFile(path, f"{other_key} = {other_value}\n{key} = {old}\n"),),
        checks=(
            Check("changed", f"assert {f'{key} = {new}'!r} in {_read(path)}.splitlines()"),
            Check("other_kept", f"assert {f'{other_key} = {other_value}'!r} in {_read(path)}.splitlines()"),
        ),
        actions=(f"sed -i 's/^{key} = {old}/{key} = {new}/' {path}",),
        mistakes=(Mistake("sed-without-i", (f"sed 's/^{key} = {old}/{key} = {new}/' {path}",)),),
    )


def copy_setting(s: Slots) -> Step:
    name, out, (key, value, other_key, other_value) = s.top(), s.top(), s.words(4)
    path, out_path = f"/app/{name}.ini", f"/app/{out}.txt"
    return Step(
        "copy_setting",
        "environment-setup",
        f"Write the value that {path} sets for {key} to {out_path}.",
        files=(EnvFile(path, f"{other_key} = {other_value}\n{key} = {value}\n"),),
        inspect=(f"cat {path}",),
        checks=(_exists(out_path), Check("value", f"assert {_read(out_path)}.strip() == {value!r}")),
        actions=(f"echo {value} > {out_path}",),
        mistakes=(Mistake("key-not-value", (f"echo {key} > {out_path}",)),),
    )


def path_entry(s: Slots) -> Step:
    directory = s.top()
    entry = f"/app/{directory}/bin"
    return Step(
        "path_entry",
        "environment-setup",
        f"Add {entry} to the PATH of new shells by appending a line to /root/.bashrc.",
        files=(EnvFile("/root/.bashrc", "alias ll='ls -l'\n"),),
        checks=(
            Check(
                "on_path",
                f"assert {entry!r} in "
                "run('bash', '-c', 'source /root/.bashrc; echo $PATH').stdout.split(':')",
            ),
            Check(
                "system_path_kept",
                "assert run('bash', '-c', 'source /root/.bashrc; command -v ls').stdout.strip()",
            ),
        ),
        actions=(f"echo 'export PATH={entry}:$PATH' >> /root/.bashrc",),
        mistakes=(Mistake("path-replaced", (f"echo 'export PATH={entry}' >> /root/.bashrc",)),),
    )


# ------------------------------------------------------------------------------------------------
# version control


def _repository(s: Slots) -> tuple[str, EnvFile, str]:
    """A git repository /app/<word> with one commit on main (files, build command)."""
    repo = f"/app/{s.top()}"
    readme = EnvFile(f"{repo}/README.md", f"# {s.word()}\n")
    build = (
        f"git init -q -b main {repo} && git -C {repo} config user.name demo && "
        f"git -C {repo} config user.email demo@example.com && git -C {repo} add -A && "
        f"git -C {repo} commit -qm initial"
    )
    return repo, readme, build


def commit_file(s: Slots) -> Step:
    repo, readme, build = _repository(s)
    name, message, text = s.words(3)
    path = f"{repo}/{name}.txt"
    return Step(
        "commit_file",
        "version-control",
        f"Commit the new file {path} to the git repository {repo} with the message {message}.",
        files=(readme,),
        build=(f"{build} && echo {text} > {path}",),  # written after the first commit: untracked
        checks=(
            Check(
                "message", f"assert git({repo!r}, 'log', '-1', '--format=%s').stdout.strip() == {message!r}"
            ),
            Check("tracked", f"assert {name + '.txt'!r} in git({repo!r}, 'ls-files').stdout.split()"),
        ),
        actions=(f"git -C {repo} add {name}.txt && git -C {repo} commit -qm {message}",),
        mistakes=(Mistake("commit-a-skips-new-files", (f"git -C {repo} commit -qam {message}",)),),
    )


def new_branch(s: Slots) -> Step:
    repo, readme, build = _repository(s)
    branch = s.word()
    return Step(
        "new_branch",
        "version-control",
        f"Create a branch {branch} in the git repository {repo} and switch to it.",
        files=(readme,),
        build=(build,),
        checks=(
            Check("exists", f"assert git({repo!r}, 'rev-parse', '--verify', {branch!r}).returncode == 0"),
            Check(
                "current", f"assert git({repo!r}, 'branch', '--show-current').stdout.strip() == {branch!r}"
            ),
        ),
        actions=(f"git -C {repo} checkout -qb {branch}",),
        mistakes=(Mistake("branch-without-switch", (f"git -C {repo} branch {branch}",)),),
    )


def switch_branch(s: Slots) -> Step:
    repo, readme, build = _repository(s)
    branch = s.word()
    return Step(
        "switch_branch",
        "version-control",
        f"The git repository {repo} has one branch besides main. Switch to that branch.",
        files=(readme,),
        build=(f"{build} && git -C {repo} branch {branch}",),
        inspect=(f"git -C {repo} branch",),
        checks=(
            Check(
                "current", f"assert git({repo!r}, 'branch', '--show-current').stdout.strip() == {branch!r}"
            ),
            Check("clean", f"assert git({repo!r}, 'status', '--porcelain').stdout == ''"),
        ),
        actions=(f"git -C {repo} checkout -q {branch}",),
        mistakes=(Mistake("create-instead-of-switch", (f"git -C {repo} checkout -qb {branch}",)),),
    )


def ignore_pattern(s: Slots) -> Step:
    repo, readme, build = _repository(s)
    junk = s.word()
    return Step(
        "ignore_pattern",
        "version-control",
        f"Make git ignore every file ending in .log in the repository {repo} by adding a pattern "
        f"to its .gitignore, keeping the pattern already there.",
        files=(readme, EnvFile(f"{repo}/.gitignore", "*.tmp\n")),
        build=(build,),
        checks=(
            Check(
                "ignored", f"assert git({repo!r}, 'check-ignore', '-q', {junk + '.log'!r}).returncode == 0"
            ),
            Check("existing_kept", f"assert git({repo!r}, 'check-ignore', '-q', 'x.tmp').returncode == 0"),
        ),
        actions=(f"echo '*.log' >> {repo}/.gitignore",),
        mistakes=(Mistake("suffix-without-star", (f"echo '.log' >> {repo}/.gitignore",)),),
    )


# ------------------------------------------------------------------------------------------------
# data processing


def count_lines(s: Slots) -> Step:
    source, out = s.top(), s.top()
    source_path, out_path = f"/app/{source}.txt", f"/app/{out}.txt"
    count = s.number(3, 9)
    return Step(
        "count_lines",
        "data-processing",
        f"Write the number of lines of {source_path} to {out_path}.",
        files=(EnvFile(source_path, _lines(s.rng.choice(SLOT_WORDS) for _ in range(count))),),
        checks=(_exists(out_path), Check("count", f"assert {_read(out_path)}.strip() == {str(count)!r}")),
        actions=(f"wc -l < {source_path} > {out_path}",),
        mistakes=(Mistake("wc-prints-name", (f"wc -l {source_path} > {out_path}",)),),
    )


def grep_ignore_case(s: Slots) -> Step:
    source, out, word = s.top(), s.top(), s.word()
    source_path, out_path = f"/app/{source}.log", f"/app/{out}.txt"
    others = [w for w in SLOT_WORDS if w != word]
    lines = [f"ok {s.rng.choice(others)}", f"{word.upper()} at start", f"ok {s.rng.choice(others)}",
             f"late {word} here"]  # fmt: skip
    s.rng.shuffle(lines)
    expected = [line for line in lines if word in line.lower()]
    return Step(
        "grep_ignore_case",
        "data-processing",
        f"Write the lines of {source_path} that contain {word}, in any letter case, to {out_path}.",
        files=(EnvFile(source_path, _lines(lines)),),
        checks=(_exists(out_path), Check("lines", f"assert {_read(out_path)}.splitlines() == {expected!r}")),
        actions=(f"grep -i {word} {source_path} > {out_path}",),
        mistakes=(Mistake("case-sensitive", (f"grep {word} {source_path} > {out_path}",)),),
    )


def sort_numbers(s: Slots) -> Step:
    source, out = s.top(), s.top()
    source_path, out_path = f"/app/{source}.txt", f"/app/{out}.txt"
    # One- and two-digit numbers, one of them 1x: as text "1x" sorts before "2", so `sort` without
    # -n always gets the order wrong.
    numbers = s.rng.sample(range(2, 10), 2) + [s.number(10, 19)] + s.rng.sample(range(20, 99), 2)
    s.rng.shuffle(numbers)
    return Step(
        "sort_numbers",
        "data-processing",
        f"Sort the numbers in {source_path} from smallest to largest and write them to {out_path}.",
        files=(EnvFile(source_path, _lines(numbers)),),
        checks=(
            _exists(out_path),
            Check("sorted", f"assert {_read(out_path)}.split() == {[str(n) for n in sorted(numbers)]!r}"),
        ),
        actions=(f"sort -n {source_path} > {out_path}",),
        mistakes=(Mistake("sort-as-text", (f"sort {source_path} > {out_path}",)),),
    )


def csv_column(s: Slots) -> Step:
    source, out, header = s.top(), s.top(), s.words(3)
    source_path, out_path = f"/app/{source}.csv", f"/app/{out}.txt"
    rows = [[s.rng.choice(SLOT_WORDS) for _ in header] for _ in range(s.number(2, 4))]
    table = [header, *rows]
    return Step(
        "csv_column",
        "data-processing",
        f"Write the second column of the comma-separated file {source_path} to {out_path}.",
        files=(EnvFile(source_path, _lines(",".join(row) for row in table)),),
        checks=(
            _exists(out_path),
            Check("column", f"assert {_read(out_path)}.split() == {[row[1] for row in table]!r}"),
        ),
        actions=(f"cut -d, -f2 {source_path} > {out_path}",),
        mistakes=(Mistake("tab-delimiter", (f"cut -f2 {source_path} > {out_path}",)),),
    )


def distinct_lines(s: Slots) -> Step:
    source, out = s.top(), s.top()
    source_path, out_path = f"/app/{source}.txt", f"/app/{out}.txt"
    values = s.words(3)
    lines = [values[0], values[1], values[0], values[2], values[1]]  # repeats not adjacent
    return Step(
        "distinct_lines",
        "data-processing",
        f"Write each distinct line of {source_path} once, sorted, to {out_path}.",
        files=(EnvFile(source_path, _lines(lines)),),
        checks=(
            _exists(out_path),
            Check("distinct", f"assert {_read(out_path)}.split() == {sorted(values)!r}"),
        ),
        actions=(f"sort -u {source_path} > {out_path}",),
        mistakes=(Mistake("uniq-unsorted", (f"uniq {source_path} > {out_path}",)),),
    )


# ------------------------------------------------------------------------------------------------
# debugging

# (misspelling, command) pairs: the shell reports the misspelled name, the fix is the command.
_TYPOS = (("ehco", "echo"), ("pritnf", "printf"), ("dtae", "date"), ("slep", "sleep"))


def fix_command_typo(s: Slots) -> Step:
    name, word = s.top(), s.word()
    path = f"/app/{name}.sh"
    typo, command = s.rng.choice(_TYPOS[:2])
    body = f"#!/bin/sh\nset -e\n{typo} {word}\n"
    return Step(
        "fix_command_typo",
        "debugging",
        f"The script {path} stops with an error. Run it, then fix the misspelled command in it.",
        files=(EnvFile(path, body),),
        inspect=(f"sh {path}",),
        checks=(
            Check("runs", f"assert run('sh', {path!r}).returncode == 0"),
            Check("prints", f"assert run('sh', {path!r}).stdout.strip() == {word!r}"),
        ),
        actions=(f"sed -i 's/{typo}/{command}/' {path}",),
        mistakes=(Mistake("sed-without-i", (f"sed 's/{typo}/{command}/' {path}",)),),
    )


def fix_range(s: Slots) -> Step:
    name = s.top()
    path = f"/app/{name}.sh"
    last = s.number(3, 9)
    return Step(
        "fix_range",
        "debugging",
        f"The script {path} should print the numbers 1 to {last} but stops early. Fix it.",
        files=(EnvFile(path, f"#!/bin/sh\nseq 1 {last - 1}\n"),),
        inspect=(f"cat {path}",),
        checks=(
            Check(
                "prints_all",
                f"assert run('sh', {path!r}).stdout.split() == {[str(i) for i in range(1, last + 1)]!r}",
            ),
            Check("uses_seq", f"assert 'seq' in {_read(path)}"),
        ),
        actions=(f"sed -i 's/seq 1 {last - 1}/seq 1 {last}/' {path}",),
        mistakes=(Mistake("sed-without-i", (f"sed 's/seq 1 {last - 1}/seq 1 {last}/' {path}",)),),
    )


def fix_name_error(s: Slots) -> Step:
    module, variable = s.top(), s.word()
    path = f"/app/{module}.py"
    typo = variable[:-1] + variable[-1] * 2  # "result" -> "resultt": Python suggests the fix
    value = s.number(2, 9)
    code = f"{variable} = {value}\nprint({typo})\n"
    return Step(
        "fix_name_error",
        "debugging",
        f"The program {path} fails with a NameError. Run it, then fix the misspelled name.",
        files=(EnvFile(path, code),),
        inspect=(f"python3 {path}",),
        checks=(
            Check("runs", f"assert run('python3', {path!r}).returncode == 0"),
            Check("prints", f"assert run('python3', {path!r}).stdout.strip() == {str(value)!r}"),
        ),
        actions=(f"sed -i 's/{typo}/{variable}/' {path}",),
        mistakes=(Mistake("sed-without-i", (f"sed 's/{typo}/{variable}/' {path}",)),),
    )


# ------------------------------------------------------------------------------------------------
# file operations


def copy_into_new_dir(s: Slots) -> Step:
    name, directory = s.top(), s.top()
    path, root = f"/app/{name}.txt", f"/app/{directory}"
    text = f"{s.word()}\n"
    return Step(
        "copy_into_new_dir",
        "file-operations",
        f"Copy {path} into a new directory {root}.",
        files=(EnvFile(path, text),),
        checks=(
            Check("copied", f"assert {_read(f'{root}/{name}.txt')} == {text!r}"),
            Check("original_kept", f"assert Path({path!r}).is_file()"),
        ),
        actions=(f"mkdir -p {root} && cp {path} {root}/",),
        mistakes=(Mistake("no-mkdir", (f"cp {path} {root}/",)),),
    )


def rename_file(s: Slots) -> Step:
    old, new = s.top(), s.top()
    old_path, new_path = f"/app/{old}.txt", f"/app/{new}.txt"
    text = f"{s.word()}\n"
    return Step(
        "rename_file",
        "file-operations",
        f"Rename {old_path} to {new_path}.",
        files=(EnvFile(old_path, text),),
        checks=(
            Check("new_name", f"assert {_read(new_path)} == {text!r}"),
            Check("old_name_gone", f"assert not Path({old_path!r}).exists()"),
        ),
        actions=(f"mv {old_path} {new_path}",),
        mistakes=(Mistake("copy-not-move", (f"cp {old_path} {new_path}",)),),
    )


def gzip_archive(s: Slots) -> Step:
    directory, archive, member = s.top(), s.top(), s.word()
    root, archive_path = f"/app/{directory}", f"/app/{archive}.tar.gz"
    return Step(
        "gzip_archive",
        "file-operations",
        f"Pack the directory {root} into the gzip-compressed tar archive {archive_path}.",
        files=(EnvFile(f"{root}/{member}.txt", "kept\n"),),
        checks=(
            Check("is_gzip", f"assert Path({archive_path!r}).read_bytes()[:2] == bytes([31, 139])"),
            Check(
                "member",
                f"assert any(n.endswith({f'{directory}/{member}.txt'!r}) "
                f"for n in tarfile.open({archive_path!r}).getnames())",
            ),
        ),
        actions=(f"tar -czf {archive_path} -C /app {directory}",),
        mistakes=(Mistake("not-compressed", (f"tar -cf {archive_path} -C /app {directory}",)),),
    )


def count_by_extension(s: Slots) -> Step:
    directory, out, names = s.top(), s.top(), s.words(4)
    root, out_path = f"/app/{directory}", f"/app/{out}.txt"
    logs = names[: s.number(1, 3)]
    files = [EnvFile(f"{root}/{n}.log", "x\n") for n in logs]
    files += [EnvFile(f"{root}/{n}.txt", "x\n") for n in names[len(logs) :]]
    return Step(
        "count_by_extension",
        "file-operations",
        f"Write the number of files ending in .log in {root} to {out_path}.",
        files=tuple(files),
        checks=(_exists(out_path), Check("count", f"assert {_read(out_path)}.strip() == {str(len(logs))!r}")),
        actions=(f"ls {root}/*.log | wc -l > {out_path}",),
        mistakes=(Mistake("counts-every-file", (f"ls {root} | wc -l > {out_path}",)),),
    )


def move_only_file(s: Slots) -> Step:
    inbox, done, name = s.top(), s.top(), s.word()
    source, target = f"/app/{inbox}", f"/app/{done}"
    text = f"{s.word()}\n"
    return Step(
        "move_only_file",
        "file-operations",
        f"Move the only file in {source} into the existing directory {target}.",
        files=(EnvFile(f"{source}/{name}.txt", text), EnvFile(f"{target}/.keep", "")),
        inspect=(f"ls -d {source}/*",),
        checks=(
            Check("moved", f"assert {_read(f'{target}/{name}.txt')} == {text!r}"),
            Check("source_empty", f"assert os.listdir({source!r}) == []"),
        ),
        actions=(f"mv {source}/{name}.txt {target}/",),
        mistakes=(Mistake("copy-not-move", (f"cp {source}/{name}.txt {target}/",)),),
    )


IDIOMS: tuple[Idiom, ...] = (
    Idiom("script_echo", "scripting", script_echo, 0.35),
    Idiom("script_count_arg", "scripting", script_count_arg, 0.4),
    Idiom("make_files", "scripting", make_files, 0.35),
    Idiom("run_only_script", "scripting", run_only_script, 0.25),
    Idiom("fix_operator", "software-development", fix_operator, 0.4),
    Idiom("append_function", "software-development", append_function, 0.35),
    Idiom("rename_function", "software-development", rename_function, 0.35),
    Idiom("private_key", "system-administration", private_key, 0.3),
    Idiom("symlink", "system-administration", symlink, 0.3),
    Idiom("cron_line", "system-administration", cron_line, 0.3),
    Idiom("clean_logs", "system-administration", clean_logs, 0.25),
    Idiom("owner_home", "system-administration", owner_home, 0.3),
    Idiom("pin_requirement", "environment-setup", pin_requirement, 0.3),
    Idiom("ini_set", "environment-setup", ini_set, 0.4),
    Idiom("copy_setting", "environment-setup", copy_setting, 0.2),
    Idiom("path_entry", "environment-setup", path_entry, 0.3),
    Idiom("commit_file", "version-control", commit_file, 0.35),
    Idiom("new_branch", "version-control", new_branch, 0.35),
    Idiom("switch_branch", "version-control", switch_branch, 0.15),
    Idiom("ignore_pattern", "version-control", ignore_pattern, 0.3),
    Idiom("count_lines", "data-processing", count_lines, 0.4),
    Idiom("grep_ignore_case", "data-processing", grep_ignore_case, 0.35),
    Idiom("sort_numbers", "data-processing", sort_numbers, 0.4),
    Idiom("csv_column", "data-processing", csv_column, 0.35),
    Idiom("distinct_lines", "data-processing", distinct_lines, 0.3),
    Idiom("fix_command_typo", "debugging", fix_command_typo, 0.35),
    Idiom("fix_range", "debugging", fix_range, 0.35),
    Idiom("fix_name_error", "debugging", fix_name_error, 0.35),
    Idiom("copy_into_new_dir", "file-operations", copy_into_new_dir, 0.35),
    Idiom("rename_file", "file-operations", rename_file, 0.25),
    Idiom("gzip_archive", "file-operations", gzip_archive, 0.35),
    Idiom("count_by_extension", "file-operations", count_by_extension, 0.3),
    Idiom("move_only_file", "file-operations", move_only_file, 0.2),
)
IDIOMS_BY_NAME = {idiom.name: idiom for idiom in IDIOMS}
# Every mistake name an idiom's steps offer (a demonstrator habit names one of these). A step's
# mistakes are named by its idiom, never by its slot values, so one step of each idiom lists them.
MISTAKE_NAMES = frozenset(
    mistake.name for idiom in IDIOMS for mistake in idiom.make(Slots(random.Random(0))).mistakes
)
