"""Dockerfile lexing shared by both backends: logical instructions and the base images (`FROM`).

This module owns reading a Dockerfile the way Docker's parser does for what the sandbox service
needs: parser directives (`# escape=`), comments, line continuations, heredocs (`RUN <<EOF` ...
`EOF`, kept inside their instruction), and the `FROM` lines of every stage with global `ARG`
defaults substituted. It interprets no other instruction (the local builder does, in `envbuild`;
the container backend leaves that to `podman build`).

Invariants:
- `logical_instructions` yields every instruction once, in order, with the number of its first
  physical line; heredoc bodies never look like instructions.
- `rewrite_from_images(text, mapping)` changes only the image word of `FROM` lines whose resolved
  image is in `mapping`; every other byte of the Dockerfile is kept.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

_DIRECTIVE = re.compile(r"^#\s*([A-Za-z]+)\s*=\s*(.+?)\s*$")
_HEREDOC = re.compile(r"<<(-?)\s*([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2")
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class Instruction:
    """One logical instruction: `keyword` upper-cased, `arguments` with continuations joined,
    `heredocs` the bodies of its heredocs (name -> text), `line` its first physical line (1-based),
    `last_line` its last."""

    line: int
    last_line: int
    keyword: str
    arguments: str
    heredocs: tuple[tuple[str, str], ...] = ()


def escape_character(text: str) -> str:
    for raw in text.splitlines():
        directive = _DIRECTIVE.match(raw.strip())
        if not directive:
            break  # parser directives must come first
        if directive.group(1).lower() == "escape":
            return directive.group(2)
    return "\\"


def logical_instructions(text: str) -> Iterator[Instruction]:
    escape = escape_character(text)
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        raw = lines[index]
        start = index + 1
        index += 1
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = []
        current = raw.rstrip()
        while current.endswith(escape):  # Docker joins continued lines verbatim, minus the escape
            parts.append(current[: -len(escape)])
            while index < len(lines) and (not lines[index].strip() or lines[index].lstrip().startswith("#")):
                index += 1
            if index >= len(lines):
                current = ""
                break
            current = lines[index].rstrip()
            index += 1
        parts.append(current)
        logical = "".join(parts).strip()
        keyword, _, arguments = logical.partition(" ")
        heredocs = []
        if keyword.upper() in ("RUN", "COPY", "ADD"):
            for match in _HEREDOC.finditer(arguments):
                strip_tabs, name = match.group(1) == "-", match.group(3)
                body = []
                while (
                    index < len(lines) and (lines[index].lstrip("\t") if strip_tabs else lines[index]) != name
                ):
                    body.append(lines[index].lstrip("\t") if strip_tabs else lines[index])
                    index += 1
                index += 1  # the terminator
                heredocs.append((name, "\n".join(body) + "\n"))
        yield Instruction(start, index, keyword.upper(), arguments.strip(), tuple(heredocs))


def substitute(value: str, variables: Mapping[str, str]) -> str:
    """Docker's `$VAR`, `${VAR}`, `${VAR:-default}` and `${VAR:+alternative}` substitution."""

    def replace(match: re.Match) -> str:
        current = variables.get(match.group(1) or match.group(4), "")
        operator, word = match.group(2), match.group(3) or ""
        if operator == "-":
            return current or word
        if operator == "+":
            return word if current else ""
        return current

    return _VARIABLE.sub(replace, value)


@dataclass(frozen=True)
class FromLine:
    """A stage's `FROM`: `token` the image word as written, `image` it with global ARGs substituted
    (None for `scratch` or a reference to an earlier stage), `stage` its `AS` name."""

    line: int
    token: str
    image: str | None
    stage: str | None


def from_lines(text: str) -> list[FromLine]:
    """Every stage's base image; raises ValueError for a FROM without an image or an unset ARG."""
    global_args: dict[str, str] = {}
    stages: set[str] = set()
    found: list[FromLine] = []
    for instruction in logical_instructions(text):
        if instruction.keyword == "ARG" and not found:
            for word in instruction.arguments.split():
                name, _, default = word.partition("=")
                global_args[name] = default.strip("\"'")
        if instruction.keyword != "FROM":
            continue
        words = [w for w in instruction.arguments.split() if not w.startswith("--")]
        if not words:
            raise ValueError(f"line {instruction.line}: FROM without an image")
        token = words[0]
        stage = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
        image = substitute(token, global_args)
        if not image or "$" in image:
            raise ValueError(f"line {instruction.line}: FROM {token}: an ARG without a default")
        if image.lower() == "scratch" or image in stages:
            found.append(FromLine(instruction.line, token, None, stage))
        else:
            found.append(FromLine(instruction.line, token, image, stage))
        if stage:
            stages.add(stage)
    if not found:
        raise ValueError("no FROM instruction")
    return found


def translate_heredocs(text: str) -> str:
    """`text` with every `RUN <<WORD` heredoc rewritten as a plain RUN that decodes the script
    (base64) and runs it with `sh`, for builders without heredoc support (buildah before 1.33, which
    podman 4.3 ships). Raises ValueError for heredocs this cannot express (COPY/ADD heredocs, several
    heredocs or a command before one)."""
    lines = text.splitlines(keepends=True)
    for instruction in reversed(list(logical_instructions(text))):
        if not instruction.heredocs:
            continue
        if (
            instruction.keyword != "RUN"
            or len(instruction.heredocs) != 1
            or not _HEREDOC.fullmatch(instruction.arguments.strip())
        ):
            raise ValueError(
                f"line {instruction.line}: {instruction.keyword} heredoc of a form the engine cannot build"
            )
        script = base64.b64encode(instruction.heredocs[0][1].encode()).decode()
        run = (
            f"RUN echo {script} | base64 -d > /tmp/.t1jax-heredoc.sh && sh /tmp/.t1jax-heredoc.sh"
            " && rm -f /tmp/.t1jax-heredoc.sh\n"
        )
        lines[instruction.line - 1 : instruction.last_line] = [run]
    return "".join(lines)


def add_stage_args(text: str, args: Mapping[str, str]) -> str:
    """`text` with `ARG NAME=value` lines after every FROM: build-time-only variables for each stage's
    RUN steps (an ARG is not kept in the image's config, unlike ENV)."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    block = "".join(f"ARG {name}={value}\n" for name, value in args.items())
    for instruction in reversed([i for i in logical_instructions(text) if i.keyword == "FROM"]):
        lines.insert(instruction.last_line, block)
    return "".join(lines)


def rewrite_from_images(text: str, mapping: Mapping[str, str]) -> str:
    """`text` with the image of each FROM line whose resolved image is a key of `mapping` replaced
    by its value."""
    lines = text.splitlines(keepends=True)
    for entry in from_lines(text):
        if entry.image is None or entry.image not in mapping or mapping[entry.image] == entry.image:
            continue
        index = entry.line - 1
        pattern = re.compile(r"(?i)^(\s*FROM\s+(?:--\S+\s+)*)" + re.escape(entry.token) + r"(?=\s|$)")
        replacement = mapping[entry.image]
        lines[index], count = pattern.subn(lambda m, new=replacement: m.group(1) + new, lines[index], count=1)
        if count != 1:
            raise ValueError(f"line {entry.line}: could not rewrite FROM {entry.token}")
    return "".join(lines)
