"""Synthetic training text for the project tokenizer: what a terminal agent reads and writes.

This module owns the text generator behind `t1jax/agent/assets/t1jax-bpe-2048.json`. Nothing is
downloaded: every document is composed here from small vocabularies of shell commands, file
paths, terminal outputs (listings, test reports, tracebacks, compiler errors), task instructions,
agent replies in the harness's tool-call format, and short summaries.

Invariant: `generate_corpus(seed, num_documents)` is a pure function of its arguments (one
`random.Random(seed)` drives every choice), so the tokenizer trained on it is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from t1jax.agent.chat_template import render_tool_call_text

WORDS = (
    "file directory config server client test data model output input error warning value index "
    "result report build install package module function class method script service process user "
    "group permission network port socket cache queue task job worker log record table column row "
    "query database schema migration version release branch commit merge patch diff archive backup "
    "image container volume mount path buffer stream parser token compiler linker library binary "
    "source header object target dependency environment variable secret key hash checksum signature "
    "request response status code message timeout retry limit memory disk cpu thread lock signal"
).split()
VERBS = (
    "create write read fix find list count remove rename move copy compile run install configure "
    "update parse extract compress decompress sort filter merge split convert validate check verify "
    "debug patch build deploy restore start stop restart download serialize train evaluate"
).split()
DIRS = (
    "/app",
    "/app/src",
    "/app/tests",
    "/app/data",
    "/tmp",
    "/var/log",
    "/etc",
    "/usr/local/bin",
    "/home/user",
    "/opt/service",
    "/srv/www",
    "/app/build",
    "/root",
    "/workspace",
)
EXTS = (
    ".py",
    ".txt",
    ".json",
    ".csv",
    ".log",
    ".c",
    ".h",
    ".sh",
    ".yaml",
    ".toml",
    ".md",
    ".rs",
    ".go",
    ".js",
    ".cfg",
    ".ini",
    ".sql",
    ".tar.gz",
    ".o",
    ".so",
)
PROGRAMS = (
    "python3",
    "bash",
    "gcc",
    "make",
    "git",
    "grep",
    "sed",
    "awk",
    "find",
    "cat",
    "ls",
    "cd",
    "echo",
    "cp",
    "mv",
    "rm",
    "mkdir",
    "chmod",
    "tar",
    "head",
    "tail",
    "wc",
    "sort",
    "uniq",
    "cut",
    "tr",
    "diff",
    "pip",
    "pytest",
    "curl",
    "jq",
    "sqlite3",
    "node",
    "cargo",
    "go",
    "ps",
    "kill",
    "df",
    "du",
    "env",
    "export",
    "which",
    "touch",
    "ln",
    "xargs",
    "tee",
)
PY_ERRORS = (
    "ModuleNotFoundError: No module named '{w}'",
    "KeyError: '{w}'",
    "ValueError: invalid literal for int() with base 10: '{w}'",
    "FileNotFoundError: [Errno 2] No such file or directory: '{p}'",
    "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
    "AssertionError: expected {n} but got {m}",
    "IndexError: list index out of range",
    "AttributeError: 'NoneType' object has no attribute '{w}'",
    "PermissionError: [Errno 13] Permission denied: '{p}'",
)


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def _name(rng: random.Random) -> str:
    parts = [_word(rng) for _ in range(rng.randint(1, 3))]
    return rng.choice(("_", "-", "")).join(parts)


def _path(rng: random.Random) -> str:
    depth = rng.randint(0, 2)
    middle = "".join("/" + _name(rng) for _ in range(depth))
    return rng.choice(DIRS) + middle + "/" + _name(rng) + rng.choice(EXTS)


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        return str(rng.randint(0, 100))
    if kind < 0.7:
        return str(rng.randint(0, 100000))
    if kind < 0.85:
        return f"{rng.uniform(0, 1000):.{rng.randint(1, 4)}f}"
    return "".join(rng.choice("0123456789abcdef") for _ in range(rng.choice((7, 8, 12, 40, 64))))


def shell_command(rng: random.Random) -> str:
    """One plausible shell command line (pipes, redirections, heredocs, quoting)."""
    p, w, n = _path(rng), _word(rng), _number(rng)
    templates = (
        f"ls -la {rng.choice(DIRS)}",
        f"cat {p}",
        f"cd {rng.choice(DIRS)} && ls",
        f'grep -rn "{w}" {rng.choice(DIRS)} | head -n {rng.randint(5, 50)}',
        f"sed -i 's/{w}/{_word(rng)}/g' {p}",
        f"awk -F, '{{print ${rng.randint(1, 9)}}}' {p} | sort | uniq -c | sort -rn",
        f"find {rng.choice(DIRS)} -name '*{rng.choice(EXTS)}' -type f | wc -l",
        f'python3 -c "import {w}; print({w}.__version__)"',
        f"python3 {p} --{w} {n}",
        f"pip install {w}=={rng.randint(0, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}",
        f"gcc -O2 -Wall -o {_name(rng)} {_name(rng)}.c -l{w}",
        f"make -j{rng.randint(1, 16)} {w}",
        "git status && git diff --stat",
        f"git log --oneline -n {rng.randint(1, 20)}",
        f"git checkout -b {_name(rng)}",
        f"tar -czf {_name(rng)}.tar.gz {rng.choice(DIRS)}",
        f"chmod +x {p} && {p}",
        f"echo '{w} = {n}' >> {p}",
        f"mkdir -p {rng.choice(DIRS)}/{_name(rng)}",
        f"head -n {rng.randint(1, 40)} {p}",
        f"tail -f {p}",
        f"wc -l {p} {_path(rng)}",
        f"pytest -q {rng.choice(DIRS)}/tests -k {w}",
        f"sqlite3 {_name(rng)}.db 'SELECT * FROM {w} LIMIT {rng.randint(1, 20)};'",
        f"jq '.{w}[] | .{_word(rng)}' {p}",
        f"ps aux | grep {w} | grep -v grep",
        f"kill -9 {rng.randint(100, 40000)}",
        f"export {w.upper()}_{_word(rng).upper()}={n}",
        f"du -sh {rng.choice(DIRS)}/*",
        f"cp {p} {_path(rng)}",
        f"mv {p} {p}.bak",
        f"rm -rf {rng.choice(DIRS)}/{_name(rng)}",
        f"cat > {p} << 'EOF'\n{python_snippet(rng)}\nEOF",
        f'for f in {rng.choice(DIRS)}/*{rng.choice(EXTS)}; do echo "$f"; wc -l "$f"; done',
        f"diff -u {p} {_path(rng)}",
        f"xargs -n 1 echo < {p}",
        f"curl -s http://localhost:{rng.randint(1000, 9999)}/{w}",
        f"cargo build --release && ./target/release/{_name(rng)}",
        f"go test ./... -run {w.capitalize()}",
        f"node {_name(rng)}.js --{w}={n}",
    )
    command = rng.choice(templates)
    if rng.random() < 0.3:  # commands also appear mid-line, after a space
        command = rng.choice((f"cd {rng.choice(DIRS)} && ", "sudo ", "time ", "timeout 60 ")) + command
    if rng.random() < 0.2:
        command += rng.choice((" 2>&1 | tail -n 20", " | head", " > /dev/null 2>&1", " || echo failed"))
    return command


def python_snippet(rng: random.Random) -> str:
    w, v = _word(rng), _word(rng)
    lines = rng.choice(
        (
            [
                f"import {w}",
                "",
                f"def {v}_{w}(path):",
                "    with open(path) as handle:",
                "        return [line.strip() for line in handle if line.strip()]",
            ],
            [
                "import json",
                "import sys",
                "",
                "data = json.load(open(sys.argv[1]))",
                f"print(len(data['{w}']))",
            ],
            [
                f"class {w.capitalize()}{v.capitalize()}:",
                "    def __init__(self, value):",
                "        self.value = value",
                "",
                "    def __repr__(self):",
                f'        return f"{w.capitalize()}({{self.value!r}})"',
            ],
            ["for i in range(10):", f"    if i % {rng.randint(2, 5)} == 0:", "        print(i, i * i)"],
        )
    )
    return "\n".join(lines)


def terminal_output(rng: random.Random) -> str:
    """Output a command could print: listings, test reports, tracebacks, compiler errors."""
    kind = rng.randrange(8)
    if kind == 0:
        rows = []
        for _ in range(rng.randint(2, 10)):
            perm = rng.choice(("-rw-r--r--", "drwxr-xr-x", "-rwxr-xr-x", "lrwxrwxrwx"))
            rows.append(
                f"{perm} 1 root root {rng.randint(0, 99999):>6} Nov {rng.randint(1, 30):>2} "
                f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {_name(rng)}{rng.choice(EXTS)}"
            )
        return f"total {rng.randint(0, 400)}\n" + "\n".join(rows)
    if kind == 1:
        tests = [
            f"tests/test_{_word(rng)}.py::test_{_name(rng).replace('-', '_')} "
            f"{rng.choice(('PASSED', 'FAILED', 'PASSED', 'ERROR'))}"
            for _ in range(rng.randint(1, 6))
        ]
        return (
            "============================= test session starts ==============================\n"
            + "\n".join(tests)
            + f"\n=========== {rng.randint(0, 9)} failed, {rng.randint(0, 30)} passed in "
            f"{rng.uniform(0, 9):.2f}s ==========="
        )
    if kind == 2:
        err = rng.choice(PY_ERRORS).format(
            w=_word(rng), p=_path(rng), n=rng.randint(0, 9), m=rng.randint(0, 9)
        )
        return (
            "Traceback (most recent call last):\n"
            f'  File "{_path(rng)}", line {rng.randint(1, 400)}, in <module>\n'
            f"    {_word(rng)}({_word(rng)})\n{err}"
        )
    if kind == 3:
        return (
            f"{_name(rng)}.c:{rng.randint(1, 300)}:{rng.randint(1, 80)}: error: "
            f"'{_word(rng)}' undeclared (first use in this function)\n"
            f"make: *** [Makefile:{rng.randint(1, 60)}: {_word(rng)}] Error 1"
        )
    if kind == 4:
        return "\n".join(f"{rng.randint(1, 99999):>7} {_name(rng)}" for _ in range(rng.randint(1, 8)))
    if kind == 5:
        return f"On branch {_name(rng)}\nChanges not staged for commit:\n" + "\n".join(
            f"\tmodified:   {_name(rng)}{rng.choice(EXTS)}" for _ in range(rng.randint(1, 4))
        )
    if kind == 6:
        return f"bash: {_word(rng)}: command not found"
    return "\n".join(f"{_word(rng)}={_number(rng)}" for _ in range(rng.randint(1, 6)))


def instruction(rng: random.Random) -> str:
    """A task statement in the style of Terminal-Bench instructions."""
    verb, obj, path = rng.choice(VERBS), _word(rng), _path(rng)
    return rng.choice(
        (
            f"{verb.capitalize()} the {obj} in {path} so that the tests pass.",
            f'Create a file called {path}. Write "{_word(rng)} {_number(rng)}" to it.',
            f"The {obj} service in {rng.choice(DIRS)} fails to start. Find the cause and {verb} it.",
            f"Write a script {path} that reads {_path(rng)} and prints the number of {obj} entries.",
            f"{verb.capitalize()} every {obj} under {rng.choice(DIRS)} and save the result to {path}.",
        )
    )


def agent_reply(rng: random.Random) -> str:
    """An assistant turn: a short analysis followed by tool calls in the harness format."""
    thought = (
        f"The {_word(rng)} {rng.choice(('is missing', 'looks wrong', 'needs a fix', 'was created'))}. "
        f"Next I will {rng.choice(VERBS)} the {_word(rng)}."
    )
    calls = []
    for _ in range(rng.randint(1, 2)):
        arguments = {"command": shell_command(rng)}
        if rng.random() < 0.5:
            arguments["duration"] = str(rng.choice((0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)))
        calls.append(render_tool_call_text("shell", arguments))
    if rng.random() < 0.1:
        calls = [render_tool_call_text("task_complete", {})]
    return thought + "\n\n" + "\n".join(calls)


def summary(rng: random.Random) -> str:
    return (
        "Summary of progress so far:\n"
        + "\n".join(
            f"- {rng.choice(VERBS)} {_path(rng)}: {rng.choice(('done', 'failed', 'pending'))}"
            for _ in range(rng.randint(2, 6))
        )
        + f"\nCurrent status: {rng.choice(('tests failing', 'almost done', 'investigating'))}."
    )


def generate_corpus(seed: int = 0, num_documents: int = 12000) -> Iterator[str]:
    """Yield `num_documents` documents, each a small mix of the text kinds above."""
    rng = random.Random(seed)
    makers = (shell_command, terminal_output, instruction, agent_reply, summary, python_snippet)
    weights = (3, 3, 1, 3, 1, 1)
    for _ in range(num_documents):
        parts = rng.choices(makers, weights=weights, k=rng.randint(1, 4))
        yield "\n".join(make(rng) for make in parts)
