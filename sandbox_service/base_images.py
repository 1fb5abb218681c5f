"""Base images: what a task's `FROM` names, and the local root that stands in for it when no
registry can serve it.

This module owns parsing image references, the table of stand-in recipes (Debian roots built
with `mmdebstrap` from the Debian mirror, shaped like the official image they replace), building
them into a cache, and the `Substitution` record that says how a stand-in differs from the image
the task asked for. Both backends use it: the container backend imports a stand-in into the
container engine when it cannot pull the real image; the local backend, which cannot pull at all,
always runs a stand-in's root (with its uids shifted into the sandboxes' uid range).

Choosing a stand-in for `image` (`stand_in_for`): the image's family (python, debian, ubuntu,
golang, gcc, node, eclipse-temurin/openjdk, rust, buildpack-deps, Terminal-Bench's t-bench bases)
and its tag pick a Debian suite. A suite the tag names (`golang:1.22-bookworm`) is kept: the
Dockerfile's `apt-get install` resolves against that suite's archive (package names, and versions
pinned as `git=1:2.39.5-0+deb12u2`, exist only there), so the language version is then that suite's.
Otherwise the language version picks the suite whose packages carry it (bookworm: Python 3.11,
GCC 12, Go 1.19, Node 18, JDK 17, Rust 1.63; trixie: Python 3.13, GCC 14, Go 1.24, Node 20, JDK 21,
Rust 1.85), and a version neither suite has maps to the nearest one. Either way the substitution
names the mismatch ("Python 3.13 instead of 3.12"). Ubuntu maps to Debian (this host has no
Ubuntu archive key). Alpine, CUDA and unknown families are unsupported, with the reason.

What every stand-in adds to what its image has: `tmux` (the terminal harness needs it; Harbor
installs it at agent setup, which needs the network). What differs is listed per recipe.

Invariants:
- A recipe's `key` hashes everything that shapes its root (suite, packages, links, env, the builder
  version); the same key always means the same recipe, and a built root is published (renamed into
  place) only after its build succeeded.
- Every use of a stand-in produces a `Substitution` naming the requested image, the stand-in and
  the differences; nothing stands in silently.
- Builds of one recipe are serialized across threads and processes (a lock file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sandbox_service.locks import file_lock

BUILDER_VERSION = "2"  # bump whenever what a recipe builds changes without its fields changing
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# Shared by every checkout and cache directory of this user: a stand-in takes a minute to build.
DEFAULT_STAND_IN_DIR = Path.home() / ".cache" / "t1jax" / "stand-ins"
STAND_IN_REPOSITORY = "localhost/t1jax-stand-in"
LABEL_RECIPE = "t1jax.stand-in.recipe"
LABEL_KEY = "t1jax.stand-in.key"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HARNESS_PACKAGES = ("tmux",)


class UnsupportedImage(ValueError):
    """No real image can be had and no stand-in recipe imitates `image` (`reason` says why)."""

    def __init__(self, image: str, reason: str):
        super().__init__(f"base image {image!r}: {reason}")
        self.image = image
        self.reason = reason


class StandInBuildError(RuntimeError):
    """mmdebstrap (or the import into the container engine) failed for a recipe."""


# ------------------------------------------------------------------------------------------------
# Image references


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference, e.g. `ghcr.io/org/app:1.2@sha256:...`. `name` is the repository's
    last path component (`python`, `ubuntu-24-04`); `tag` defaults to `latest`."""

    text: str
    registry: str
    repository: str
    tag: str
    digest: str | None

    @property
    def name(self) -> str:
        return self.repository.rsplit("/", 1)[-1].lower()

    @classmethod
    def parse(cls, text: str) -> ImageRef:
        rest, _, digest = text.strip().partition("@")
        if not rest or any(c.isspace() for c in rest):
            raise ValueError(f"not an image reference: {text!r}")
        first, slash, remainder = rest.partition("/")
        if slash and ("." in first or ":" in first or first == "localhost"):
            registry, path = first, remainder
        else:
            registry, path = "docker.io", rest
        repository, colon, tag = path.rpartition(":") if ":" in path.rsplit("/", 1)[-1] else (path, "", "")
        if registry == "docker.io" and "/" not in repository:
            repository = f"library/{repository}"
        return cls(text.strip(), registry, repository, tag or "latest", digest or None)


# ------------------------------------------------------------------------------------------------
# Recipes


@dataclass(frozen=True)
class StandInRecipe:
    """How to build one stand-in root: a Debian `suite` (minbase) plus `packages`, then `links`
    (path -> target), `directories`, removed `remove_globs`, and the image config (`env`, `cmd`).
    `summary` says in words what the root is."""

    name: str
    suite: str
    packages: tuple[str, ...]
    summary: str
    env: tuple[tuple[str, str], ...] = (("PATH", DEFAULT_PATH), ("LANG", "C.UTF-8"))
    links: tuple[tuple[str, str], ...] = ()
    directories: tuple[str, ...] = ()
    remove_globs: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ("bash",)

    @property
    def key(self) -> str:
        fields = {**dataclasses.asdict(self), "builder": BUILDER_VERSION, "harness": HARNESS_PACKAGES}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def image_tag(self) -> str:
        """The tag under which the container backend imports this stand-in."""
        return f"{STAND_IN_REPOSITORY}/{self.name}:{self.key}"

    def all_packages(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.packages, *HARNESS_PACKAGES)))


@dataclass(frozen=True)
class Substitution:
    """A stand-in used in place of the image a task names. `differences` lists, in words, how the
    stand-in differs from that image (always at least that it is a locally built Debian root)."""

    requested: str
    stand_in: str  # the recipe's image tag
    recipe: str
    differences: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.requested} -> {self.stand_in} ({'; '.join(self.differences)})"

    def to_json(self) -> dict:
        return {
            "requested": self.requested,
            "stand_in": self.stand_in,
            "recipe": self.recipe,
            "differences": list(self.differences),
        }


@dataclass(frozen=True)
class _Suite:
    name: str
    debian: int
    python: str
    gcc: int
    go: str
    node: int
    jdk: int
    rust: str


SUITES = (
    _Suite("bookworm", 12, "3.11", 12, "1.19", 18, 17, "1.63"),
    _Suite("trixie", 13, "3.13", 14, "1.24", 20, 21, "1.85"),
)
_BY_NAME = {suite.name: suite for suite in SUITES}
_DEBIAN_ALIASES = {
    "bookworm": "bookworm",
    "12": "bookworm",
    "trixie": "trixie",
    "13": "trixie",
    "latest": "trixie",
    "stable": "trixie",
}
_UBUNTU_TO_DEBIAN = {
    "20.04": "bookworm",
    "22.04": "bookworm",
    "24.04": "trixie",
    "24.10": "trixie",
    "25.04": "trixie",
    "focal": "bookworm",
    "jammy": "bookworm",
    "noble": "trixie",
    "latest": "trixie",
}
_UBUNTU_RELEASE = {"focal": "20.04", "jammy": "22.04", "noble": "24.04"}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _named_suite(tag: str) -> _Suite | None:
    """The Debian suite a tag names as a word (`1.22.7-bookworm`, `3.12-slim-trixie`), if any."""
    return next((suite for suite in SUITES if suite.name in _tag_words(tag)), None)


def _suite_for(tag: str, wanted: str, attribute: str) -> tuple[_Suite, str | None]:
    """The suite for an image whose tag asks for `attribute` version `wanted`: the suite the tag
    names, else `_nearest_suite`; with a note naming a version mismatch."""
    named = _named_suite(tag)
    if named is None:
        return _nearest_suite(wanted, attribute)
    have = str(getattr(named, attribute))
    if _version_tuple(have) == _version_tuple(wanted):
        return named, None
    return named, f"{have} instead of {wanted} (the tag names Debian {named.name}, kept for its apt archive)"


def _nearest_suite(wanted: str, attribute: str) -> tuple[_Suite, str | None]:
    """The suite whose `attribute` version equals `wanted`, else the nearest (ties: the newer),
    with a note naming the mismatch."""
    target = _version_tuple(wanted)
    for suite in SUITES:
        if _version_tuple(str(getattr(suite, attribute))) == target:
            return suite, None

    def distance(suite: _Suite) -> tuple:
        have = _version_tuple(str(getattr(suite, attribute)))
        width = max(len(have), len(target))
        pad = lambda v: v + (0,) * (width - len(v))  # noqa: E731
        gap = [abs(a - b) for a, b in zip(pad(have), pad(target), strict=True)]
        return (*gap, -suite.debian)

    suite = min(SUITES, key=distance)
    return suite, f"{getattr(suite, attribute)} instead of {wanted}"


_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([\w.+!-]+)$")
_WHEEL_CACHE: dict[tuple[str, str], bool] = {}


def pinned_python_requirements(dockerfile_text: str) -> tuple[str, ...]:
    """The `name==version` requirements a Dockerfile's RUN lines install with pip or uv."""
    from sandbox_service.verifier import script_test_requirements  # the same install-line reader

    return tuple(r for r in script_test_requirements(dockerfile_text) if _PIN.match(r))


def has_wheel(requirement: str, python: str, *, timeout_sec: float = 60.0) -> bool | None:
    """Whether the package index pip is configured for has a wheel of `requirement` for CPython
    `python` (x.y) on x86-64 Linux (`pip install --dry-run --only-binary=:all:` for that
    interpreter: it resolves, downloads nothing but metadata); None when pip cannot tell
    (offline, an index error). Answers are cached per process."""
    import sys

    from sandbox_service.verifier import WHEEL_PLATFORMS

    key = (requirement.lower(), python)
    if key in _WHEEL_CACHE:
        return _WHEEL_CACHE[key]
    abi = "cp3" + python.split(".")[1]
    command = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps", "--ignore-installed",
        "--disable-pip-version-check", "--only-binary=:all:", "--target", "/nonexistent/t1jax-wheel-probe",
        "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
        *(arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)), requirement,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_sec)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode == 0:
        _WHEEL_CACHE[key] = True
    elif "No matching distribution found" in done.stderr:
        _WHEEL_CACHE[key] = False
    else:
        return None
    return _WHEEL_CACHE[key]


def nearest_python_with_wheels(
    wanted: str, pins: tuple[str, ...], *, default: tuple[_Suite, str | None]
) -> tuple[_Suite, str | None]:
    """Of the suites whose Python is nearest to `wanted`, the first (newer first) for which the
    index has a wheel of every pin, with a note saying why it was chosen; `default` when pip
    cannot tell or no nearest suite has them all (a pin without any wheel decides nothing)."""
    target = _version_tuple(wanted)
    gaps = {suite.name: abs(_version_tuple(suite.python)[1] - target[1]) for suite in SUITES}
    nearest = sorted((s for s in SUITES if gaps[s.name] == min(gaps.values())), key=lambda s: -s.debian)
    if len(nearest) < 2:
        return default
    answers = {(pin, s.name): has_wheel(pin, s.python) for pin in pins for s in nearest}
    if None in answers.values():
        return default
    deciding = [pin for pin in pins if any(answers[(pin, s.name)] for s in nearest)]
    fits = [s for s in nearest if all(answers[(pin, s.name)] for pin in deciding)]
    if not deciding or not fits or fits[0] is nearest[0]:
        return default
    chosen = fits[0]
    lacking = " and ".join(s.python for s in nearest if s not in fits)
    return chosen, (
        f"{chosen.python} instead of {wanted} (as near as {lacking}, for which the index has no wheel "
        f"of {', '.join(deciding)})"
    )


# What the non-slim official images (python:3.x, node:N, built on buildpack-deps) have beyond slim.
BUILDPACK_PACKAGES = ("build-essential", "git", "curl", "wget", "gnupg", "openssh-client", "procps",
                      "pkg-config", "libssl-dev", "libffi-dev", "zlib1g-dev")  # fmt: skip


def _python_recipe(suite: _Suite, *, slim: bool = True) -> StandInRecipe:
    return StandInRecipe(
        name=f"python-{suite.python}-{suite.name}" + ("" if slim else "-full"),
        suite=suite.name,
        packages=(
            "python3",
            "python3-pip",
            "python3-venv",
            "python3-dev",
            "ca-certificates",
            "netbase",
            "tzdata",
            *(() if slim else BUILDPACK_PACKAGES),
        ),  # fmt: skip
        summary=f"Debian {suite.debian} ({suite.name}) with Debian's Python {suite.python} in /usr/bin"
        + ("" if slim else " and the buildpack-deps tools (gcc, git, curl...)"),
        links=(
            ("/usr/local/bin/python", "/usr/bin/python3"),
            ("/usr/local/bin/python3", "/usr/bin/python3"),
            ("/usr/local/bin/pip", "/usr/bin/pip3"),
            ("/usr/local/bin/pip3", "/usr/bin/pip3"),
        ),
        remove_globs=("/usr/lib/python3*/EXTERNALLY-MANAGED",),  # the official images allow pip
        env=(("PATH", DEFAULT_PATH), ("LANG", "C.UTF-8"), ("PYTHON_VERSION", suite.python)),
        cmd=("python3",),
    )


def _debian_recipe(suite: _Suite) -> StandInRecipe:
    return StandInRecipe(
        name=f"debian-{suite.name}",
        suite=suite.name,
        packages=(),
        summary=f"Debian {suite.debian} ({suite.name}) minbase",
    )


# What Ubuntu's base image (ubuntu-base, the root of ubuntu:XX.04) has beyond Debian's minbase: its
# manifest lists procps (ps, pgrep, kill), e2fsprogs and sensible-utils among the required packages.
UBUNTU_BASE_EXTRAS = ("procps", "e2fsprogs", "sensible-utils")


def _ubuntu_recipe(suite: _Suite) -> StandInRecipe:
    return StandInRecipe(
        name=f"debian-{suite.name}-ubuntu-base",
        suite=suite.name,
        packages=UBUNTU_BASE_EXTRAS,
        summary=f"Debian {suite.debian} ({suite.name}) minbase with Ubuntu base's extra packages "
        f"({', '.join(UBUNTU_BASE_EXTRAS)})",
    )


def _buildpack_recipe(suite: _Suite) -> StandInRecipe:
    return StandInRecipe(
        name=f"buildpack-deps-{suite.name}",
        suite=suite.name,
        packages=(
            "ca-certificates",
            "curl",
            "wget",
            "gnupg",
            "git",
            "openssh-client",
            "procps",
            "build-essential",
            "pkg-config",
        ),  # fmt: skip
        summary=f"Debian {suite.debian} ({suite.name}) with curl, git and build-essential "
        "(not every -dev library of buildpack-deps)",
    )


def _golang_recipe(suite: _Suite) -> StandInRecipe:
    go_root = f"/usr/lib/go-{suite.go}"
    return StandInRecipe(
        name=f"golang-{suite.go}-{suite.name}",
        suite=suite.name,
        packages=(
            f"golang-{suite.go}-go",
            "ca-certificates",
            "git",
            "gcc",
            "libc6-dev",
            "make",
            "pkg-config",
        ),  # fmt: skip
        summary=f"Debian {suite.debian} ({suite.name}) with Debian's Go {suite.go} at /usr/local/go",
        links=(("/usr/local/go", go_root),),
        directories=("/go/bin", "/go/src"),
        env=(
            ("PATH", f"/go/bin:/usr/local/go/bin:{DEFAULT_PATH}"),
            ("GOPATH", "/go"),
            ("GOLANG_VERSION", suite.go),
            ("LANG", "C.UTF-8"),
        ),
    )


def _gcc_recipe(suite: _Suite, version: int) -> StandInRecipe:
    return StandInRecipe(
        name=f"gcc-{version}-{suite.name}",
        suite=suite.name,
        packages=(f"gcc-{version}", f"g++-{version}", "build-essential", "ca-certificates", "curl", "git"),
        summary=f"Debian {suite.debian} ({suite.name}) with Debian's GCC {version} as gcc/g++",
        links=(
            ("/usr/local/bin/gcc", f"/usr/bin/gcc-{version}"),
            ("/usr/local/bin/g++", f"/usr/bin/g++-{version}"),
        ),
    )


def _node_recipe(suite: _Suite, *, slim: bool = True) -> StandInRecipe:
    return StandInRecipe(
        name=f"node-{suite.node}-{suite.name}" + ("" if slim else "-full"),
        suite=suite.name,
        packages=("nodejs", "npm", "ca-certificates", *(() if slim else BUILDPACK_PACKAGES)),
        summary=f"Debian {suite.debian} ({suite.name}) with Debian's Node.js {suite.node} and npm",
        cmd=("node",),
    )


def _java_recipe(suite: _Suite, jre: bool) -> StandInRecipe:
    kind = "jre" if jre else "jdk"
    home = f"/usr/lib/jvm/java-{suite.jdk}-openjdk-amd64"
    return StandInRecipe(
        name=f"openjdk-{suite.jdk}-{kind}-{suite.name}",
        suite=suite.name,
        packages=(f"openjdk-{suite.jdk}-{kind}-headless", "ca-certificates"),
        summary=f"Debian {suite.debian} ({suite.name}) with Debian's OpenJDK {suite.jdk} "
        f"({kind}, headless) at /opt/java/openjdk",
        links=(("/opt/java/openjdk", home),),
        env=(
            ("PATH", f"/opt/java/openjdk/bin:{DEFAULT_PATH}"),
            ("JAVA_HOME", "/opt/java/openjdk"),
            ("LANG", "C.UTF-8"),
        ),  # fmt: skip
        cmd=("jshell",),
    )


def _rust_recipe(suite: _Suite) -> StandInRecipe:
    return StandInRecipe(
        name=f"rust-{suite.rust}-{suite.name}",
        suite=suite.name,
        packages=("rustc", "cargo", "ca-certificates", "gcc", "libc6-dev"),
        summary=f"Debian {suite.debian} ({suite.name}) with Debian's Rust {suite.rust} and cargo (no rustup)",
    )


_VERSION = re.compile(r"^(\d+(?:\.\d+)*)")
_UNSUPPORTED_FAMILIES = {
    "alpine": "Alpine Linux: no Alpine mirror is reachable here, and a Debian root has no apk",
    "scratch": "an empty image: nothing to stand in for",
    "cuda": "CUDA images need NVIDIA's libraries and a GPU",
    "busybox": "busybox images: no stand-in recipe",
}


def _tag_version(tag: str) -> str | None:
    match = _VERSION.match(tag)
    return match.group(1) if match else None


def _tag_words(tag: str) -> set[str]:
    return set(re.split(r"[-_.]", tag.lower()))


def stand_in_for(image: str, *, python_pins: tuple[str, ...] = ()) -> tuple[StandInRecipe, Substitution]:
    """The stand-in recipe for `image` and the `Substitution` describing the swap. `python_pins`
    (`name==version` requirements the task's Dockerfile installs with pip) decide between suites
    whose Pythons are equally near the one the tag asks for: the first with a wheel of every pin
    (`nearest_python_with_wheels`).

    Raises `UnsupportedImage` for families no recipe imitates (see the module docstring)."""
    try:
        ref = ImageRef.parse(image)
    except ValueError as error:
        raise UnsupportedImage(image, str(error)) from None
    name, tag = ref.name, ref.tag.lower()
    for family, reason in _UNSUPPORTED_FAMILIES.items():
        if family in name or family in _tag_words(tag):
            raise UnsupportedImage(image, reason)
    notes: list[str] = []
    recipe: StandInRecipe
    t_bench = ref.registry == "ghcr.io" and "t-bench" in ref.repository
    if t_bench:  # Terminal-Bench's base images: python-3-13, ubuntu-24-04, debian-12, ...
        family, _, version = name.partition("-")
        name, tag = family, version.replace("-", ".")
        notes.append("Terminal-Bench base image rebuilt from Debian (its extra tools are not all here)")
    if name in ("python", "pypy"):
        version = _tag_version(tag) or _BY_NAME["trixie"].python
        wanted = ".".join(version.split(".")[:2])
        suite, mismatch = _suite_for(tag, wanted, "python")
        if mismatch and python_pins and _named_suite(tag) is None:
            suite, mismatch = nearest_python_with_wheels(wanted, python_pins, default=(suite, mismatch))
        recipe = _python_recipe(suite, slim="slim" in _tag_words(tag))
        if mismatch:
            notes.append(f"Python {mismatch}")
        notes.append(
            "Debian's python3 package in /usr/bin (linked from /usr/local/bin), not a /usr/local build"
        )
        if name == "pypy":
            notes.append("CPython instead of PyPy")
    elif name == "debian":
        words = _tag_words(tag)
        suite_name = next((_DEBIAN_ALIASES[w] for w in words if w in _DEBIAN_ALIASES), None)
        if suite_name is None:
            suite_name = "bookworm" if words & {"bullseye", "buster", "11", "10"} else "trixie"
            notes.append(f"Debian {suite_name} instead of {tag}")
        recipe = _debian_recipe(_BY_NAME[suite_name])
    elif name == "ubuntu":
        release = tag.split("-")[0]
        suite_name = _UBUNTU_TO_DEBIAN.get(release) or _UBUNTU_TO_DEBIAN.get(
            _tag_version(release) or "", "trixie"
        )
        recipe = _ubuntu_recipe(_BY_NAME[suite_name])
        shown = _UBUNTU_RELEASE.get(release, release)
        notes.append(
            f"Debian {_BY_NAME[suite_name].debian} ({suite_name}) instead of Ubuntu {shown} "
            "(no Ubuntu archive key on this host)"
        )
    elif name == "buildpack-deps":
        words = _tag_words(tag)
        suite_name = next((s for s in _BY_NAME if s in words), None)
        if suite_name is None:
            suite_name = _UBUNTU_TO_DEBIAN.get(tag.split("-")[0], "trixie")
            notes.append(f"Debian {suite_name} instead of {tag}")
        recipe = _buildpack_recipe(_BY_NAME[suite_name])
    elif name == "golang":
        version = _tag_version(tag) or _BY_NAME["trixie"].go
        suite, mismatch = _suite_for(tag, ".".join(version.split(".")[:2]), "go")
        recipe = _golang_recipe(suite)
        if mismatch:
            notes.append(f"Go {mismatch}")
        notes.append("Debian's Go package, linked at /usr/local/go")
    elif name == "gcc":
        version = int((_tag_version(tag) or "14").split(".")[0])
        named = _named_suite(tag)
        suite = named or (_BY_NAME["trixie"] if version >= 13 else _BY_NAME["bookworm"])
        available = {"bookworm": (11, 12), "trixie": (12, 13, 14)}[suite.name]
        used = version if version in available else min(available, key=lambda v: (abs(v - version), -v))
        recipe = _gcc_recipe(suite, used)
        if used != version:
            kept = f" (the tag names Debian {suite.name}, kept for its apt archive)" if named else ""
            notes.append(f"GCC {used} instead of {version}{kept}")
    elif name == "node":
        version = (_tag_version(tag) or str(_BY_NAME["trixie"].node)).split(".")[0]
        suite, mismatch = _suite_for(tag, version, "node")
        recipe = _node_recipe(suite, slim="slim" in _tag_words(tag))
        if mismatch:
            notes.append(f"Node.js {mismatch}")
    elif name in ("eclipse-temurin", "openjdk", "amazoncorretto", "maven"):
        version = (_tag_version(tag) or str(_BY_NAME["trixie"].jdk)).split(".")[0]
        suite, mismatch = _suite_for(tag, version, "jdk")
        recipe = _java_recipe(suite, jre="jre" in _tag_words(tag))
        if mismatch:
            notes.append(f"JDK {mismatch}")
        notes.append(f"Debian's OpenJDK instead of {name}")
        if name == "maven":
            notes.append("no Maven installed")
    elif name == "rust":
        version = _tag_version(tag) or _BY_NAME["trixie"].rust
        suite, mismatch = _suite_for(tag, ".".join(version.split(".")[:2]), "rust")
        recipe = _rust_recipe(suite)
        if mismatch:
            notes.append(f"Rust {mismatch}")
    else:
        raise UnsupportedImage(image, f"no stand-in recipe for image family {name!r}")
    differences = (f"stand-in: {recipe.summary}", *notes, "tmux added for the terminal harness")
    return recipe, Substitution(image, recipe.image_tag, recipe.name, tuple(differences))


# ------------------------------------------------------------------------------------------------
# Building and caching


def _customize_script(recipe: StandInRecipe, packages_file: Path) -> str:
    """Shell run by mmdebstrap's customize hook with the new root as "$1"."""
    lines = [
        "set -e",
        'root="$1"',
        f"chroot \"$root\" dpkg-query -W -f='${{Package}} ${{Version}}\\n' > {packages_file}",
    ]
    for directory in recipe.directories:
        lines.append(f'mkdir -p "$root{directory}"')
    for link, target in recipe.links:
        lines.append(f'mkdir -p "$root{os.path.dirname(link)}" && ln -sfn {target} "$root{link}"')
    for pattern in recipe.remove_globs:
        lines.append(f'rm -rf "$root"{pattern}')
    # The build's own apt options (no recommends) must not stay: the official images install
    # recommended packages, and tasks rely on it (`apt-get install gcc` brings libc6-dev).
    lines.append('rm -f "$root"/etc/apt/apt.conf.d/99mmdebstrap')
    # What the official images do: no apt lists or caches in the image.
    lines.append(
        'rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb'
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class BuiltStandIn:
    """A built stand-in: its root filesystem as a tarball plus the manifest of how it was made."""

    recipe: StandInRecipe
    tarball: Path
    manifest: dict

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        return self.recipe.env


class StandInStore:
    """Builds stand-in roots into `directory` (`<name>-<key>.tar` + `.json`), once per recipe key.

    `shifted_root(recipe, uid_base)` extracts a built root with every uid/gid shifted by
    `uid_base` (the local backend's sandbox uid range), also once. Thread- and process-safe."""

    def __init__(self, directory: str | Path | None = None, *, mirror: str = DEBIAN_MIRROR,
                 build_timeout_sec: float = 1800.0):  # fmt: skip
        self.directory = Path(directory or DEFAULT_STAND_IN_DIR).resolve()
        self.mirror = mirror
        self.build_timeout_sec = build_timeout_sec
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _paths(self, recipe: StandInRecipe) -> tuple[Path, Path]:
        stem = f"{recipe.name}-{recipe.key}"
        return self.directory / f"{stem}.tar", self.directory / f"{stem}.json"

    def built(self, recipe: StandInRecipe) -> BuiltStandIn | None:
        tarball, manifest = self._paths(recipe)
        if tarball.is_file() and manifest.is_file():
            return BuiltStandIn(recipe, tarball, json.loads(manifest.read_text()))
        return None

    def build(self, recipe: StandInRecipe, *, log=None) -> BuiltStandIn:
        """The built stand-in, from the cache or built now with mmdebstrap (needs root and the
        Debian mirror; ~30-90 s)."""
        existing = self.built(recipe)
        if existing is not None:
            return existing
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._lock(recipe), file_lock(self.directory / f".{recipe.name}-{recipe.key}.lock"):
            existing = self.built(recipe)
            if existing is not None:
                return existing
            tarball, manifest_path = self._paths(recipe)
            staging = self.directory / f".{recipe.name}-{recipe.key}.building-{os.getpid()}.tar"
            packages_file = self.directory / f".{recipe.name}-{recipe.key}.packages"
            scratch = self.directory / f".{recipe.name}-{recipe.key}.scratch"  # mmdebstrap's TMPDIR
            _remove_scratch(scratch)  # what a build that died (holding this lock) left, mounts included
            scratch.mkdir()
            mmdebstrap = shutil.which("mmdebstrap")
            if mmdebstrap is None:
                raise StandInBuildError(
                    "building stand-in base images needs mmdebstrap (apt-get install mmdebstrap; "
                    "`make setup` installs it)"
                )
            command = [
                mmdebstrap,
                "--variant=minbase",
                "--mode=root",
                "--format=tar",
                f"--include={','.join(recipe.all_packages())}",
                '--aptopt=APT::Install-Recommends "false"',
                f"--customize-hook={_customize_script(recipe, packages_file)}",
                recipe.suite,
                str(staging),
                self.mirror,
            ]
            if log:
                log(
                    f"building stand-in {recipe.name} "
                    f"(Debian {recipe.suite} + {len(recipe.all_packages())} packages)"
                )
            started = time.monotonic()
            try:
                done = subprocess.run(
                    command,
                    capture_output=True,
                    text=True,
                    timeout=self.build_timeout_sec,
                    env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "TMPDIR": str(scratch)},
                )
            except subprocess.TimeoutExpired as error:
                staging.unlink(missing_ok=True)
                _remove_scratch(scratch)
                raise StandInBuildError(f"mmdebstrap for {recipe.name} timed out") from error
            if done.returncode != 0:
                staging.unlink(missing_ok=True)
                _remove_scratch(scratch)
                raise StandInBuildError(
                    f"mmdebstrap for stand-in {recipe.name} failed (exit {done.returncode}): "
                    f"{(done.stderr or done.stdout)[-3000:]}"
                )
            _remove_scratch(scratch)
            manifest = {
                "recipe": dataclasses.asdict(recipe),
                "key": recipe.key,
                "mirror": self.mirror,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - started, 1),
                "packages": _package_versions(packages_file, recipe.all_packages()),
            }
            os.replace(staging, tarball)
            tmp = self.directory / f".{manifest_path.name}.tmp"
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, manifest_path)
        return BuiltStandIn(recipe, tarball, manifest)

    def shifted_root(self, recipe: StandInRecipe, uid_base: int, *, log=None) -> Path:
        """The stand-in's root extracted with uids/gids shifted by `uid_base` (read-only after)."""
        built = self.build(recipe, log=log)
        final = self.directory / f"{recipe.name}-{recipe.key}.root-{uid_base}"
        if final.is_dir():  # published by rename only once complete
            return final
        with self._lock(recipe), file_lock(self.directory / f".{recipe.name}-{recipe.key}.lock"):
            if final.is_dir():
                return final
            staging = self.directory / f".{final.name}.extracting-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            _extract_shifted(built.tarball, staging, uid_base)
            os.rename(staging, final)
        return final

    def _lock(self, recipe: StandInRecipe) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(recipe.key, threading.Lock())


def _package_versions(listing: Path, packages: Iterable[str]) -> dict[str, str]:
    """Installed versions of `packages`, from the `dpkg-query -W` listing the build wrote."""
    wanted = set(packages)
    versions = {}
    for line in listing.read_text().splitlines() if listing.is_file() else []:
        name, _, version = line.partition(" ")
        if name in wanted:
            versions[name] = version
    listing.unlink(missing_ok=True)
    return versions


def _remove_scratch(scratch: Path) -> None:
    """Unmount whatever an interrupted mmdebstrap left mounted under `scratch` (its chroot's /proc,
    /sys, /dev), deepest first, then delete it."""
    if not scratch.exists():
        return
    prefix = str(scratch.resolve()) + "/"
    mounts = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)
    shutil.rmtree(scratch, ignore_errors=True)


def _extract_shifted(tarball: Path, target: Path, uid_base: int) -> None:
    """Extract a root tarball (as root) with every owner shifted by `uid_base`; device nodes are
    skipped (sandboxes get their own /dev)."""
    target.mkdir(parents=True)
    with tarfile.open(tarball) as archive:
        for member in archive:
            if member.isdev():
                continue
            member = member.replace(uid=member.uid + uid_base, gid=member.gid + uid_base, uname="", gname="")
            archive.extract(member, target, filter="fully_trusted", numeric_owner=True)
    os.chmod(target, 0o755)
    os.chown(target, uid_base, uid_base)
