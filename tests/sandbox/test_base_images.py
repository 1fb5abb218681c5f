"""Base images: references, which stand-in imitates which image (and says how it differs), and the
built roots themselves (real mmdebstrap output from `make setup`)."""

import subprocess
import sys

import pytest

from sandbox_service.base_images import (
    ImageRef,
    StandInStore,
    UnsupportedImage,
    has_wheel,
    pinned_python_requirements,
    stand_in_for,
)
from sandbox_service.contracts import EnvironmentAudit, ImageSubstitution
from sandbox_service.fidelity import stand_in_gap

from .conftest import STAND_IN_DIR


def test_image_references_parse_like_docker():
    ref = ImageRef.parse("ghcr.io/laude-institute/t-bench/python-3-13:20250620")
    assert (ref.registry, ref.repository, ref.tag, ref.name) == (
        "ghcr.io", "laude-institute/t-bench/python-3-13", "20250620", "python-3-13",
    )  # fmt: skip
    ref = ImageRef.parse("python:3.13-slim-bookworm@sha256:" + "a" * 64)
    assert (ref.registry, ref.repository, ref.tag, ref.digest[:7]) == (
        "docker.io",
        "library/python",
        "3.13-slim-bookworm",
        "sha256:",
    )
    assert ImageRef.parse("localhost:5000/app").registry == "localhost:5000"
    assert ImageRef.parse("ubuntu").tag == "latest"


@pytest.mark.parametrize(
    "image,recipe,noted",
    [
        ("python:3.11-slim", "python-3.11-bookworm", "Debian's python3 package"),
        ("python:3.13", "python-3.13-trixie-full", "buildpack-deps tools"),
        ("python:3.12-slim", "python-3.13-trixie", "Python 3.13 instead of 3.12"),
        # A suite the tag names is kept (the Dockerfile's apt-get uses its archive), the language
        # version is that suite's.
        ("python:3.12-slim-bookworm", "python-3.11-bookworm",
         "Python 3.11 instead of 3.12 (the tag names Debian bookworm"),
        ("public.ecr.aws/docker/library/python:3.13-slim-bookworm", "python-3.11-bookworm",
         "Python 3.11 instead of 3.13"),
        ("python:3.11-slim-trixie", "python-3.13-trixie", "Python 3.13 instead of 3.11"),
        ("golang:1.22.7-bookworm", "golang-1.19-bookworm", "Go 1.19 instead of 1.22 (the tag"),
        ("gcc:13.3.0-bookworm", "gcc-12-bookworm", "GCC 12 instead of 13 (the tag names Debian"),
        ("node:20-bookworm-slim", "node-18-bookworm", "Node.js 18 instead of 20"),
        ("ubuntu:24.04", "debian-trixie-ubuntu-base", "instead of Ubuntu 24.04"),
        ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624", "debian-trixie-ubuntu-base",
         "Terminal-Bench base image"),
        ("debian:bookworm-slim", "debian-bookworm", "minbase"),
        ("golang:1.22", "golang-1.24-trixie", "Go 1.24 instead of 1.22"),
        ("gcc:13", "gcc-13-trixie", "GCC 13"),
        ("node:20-slim", "node-20-trixie", "Node.js 20"),
        ("eclipse-temurin:17-jre", "openjdk-17-jre-bookworm", "instead of eclipse-temurin"),
        ("rust:1.85", "rust-1.85-trixie", "no rustup"),
    ],
)  # fmt: skip
def test_stand_ins_are_chosen_by_family_and_version_and_say_how_they_differ(image, recipe, noted):
    chosen, substitution = stand_in_for(image)
    assert chosen.name == recipe and substitution.recipe == recipe and substitution.requested == image
    assert substitution.stand_in == chosen.image_tag and chosen.image_tag.startswith(
        "localhost/t1jax-stand-in/"
    )
    text = substitution.describe()
    assert noted in text and "tmux added for the terminal harness" in text


@pytest.mark.parametrize(
    "image,reason",
    [("alpine:3.19", "Alpine"), ("python:3.12-alpine", "Alpine"),
     ("nvidia/cuda:12.4.0-devel-ubuntu22.04", "CUDA"),
     ("mcr.microsoft.com/dotnet/sdk:8.0", "no stand-in recipe"), ("scratch", "empty image")],
)  # fmt: skip
def test_families_nothing_imitates_are_unsupported_with_the_reason(image, reason):
    with pytest.raises(UnsupportedImage, match=reason):
        stand_in_for(image)


def test_recipe_keys_change_exactly_with_the_recipe():
    first, _ = stand_in_for("python:3.11-slim")
    again, _ = stand_in_for("python:3.11")
    assert first.key == stand_in_for("python:3.11-slim-bookworm")[0].key  # the same recipe
    assert first.key != again.key  # slim and full differ in packages


def test_a_built_stand_in_is_a_real_debian_root_with_the_official_images_apt_defaults():
    recipe, _ = stand_in_for("python:3.11-slim")
    store = StandInStore(STAND_IN_DIR)
    built = store.built(recipe) or store.build(recipe)
    assert built.manifest["key"] == recipe.key and built.manifest["packages"]["python3"].startswith("3.11")
    root = store.shifted_root(recipe, 1_700_000_000)
    assert (root / "etc" / "debian_version").read_text().startswith("12.")
    assert (root / "usr" / "local" / "bin" / "python3").readlink().as_posix() == "/usr/bin/python3"
    assert not (root / "etc" / "apt" / "apt.conf.d" / "99mmdebstrap").exists()  # recommends stay on
    assert not list(root.glob("usr/lib/python3*/EXTERNALLY-MANAGED")) and not list(
        root.glob("var/lib/apt/lists/*_Packages")
    )


# -- the nearest version that exists, and gaps a stand-in's version explains ----------------------


def test_pinned_wheels_pick_the_nearest_python_that_has_them():
    """python:3.12 is as near to bookworm's 3.11 as to trixie's 3.13; numpy 1.26.4 has wheels up to
    3.12 only (asked of the package index pip is configured for), so bookworm stands in, and says so."""
    pins = pinned_python_requirements(
        "FROM python:3.12-slim\nRUN pip install --no-cache-dir numpy==1.26.4 rich\n"
    )
    assert pins == ("numpy==1.26.4",)
    assert has_wheel("numpy==1.26.4", "3.11") is True and has_wheel("numpy==1.26.4", "3.13") is False
    recipe, substitution = stand_in_for("python:3.12-slim", python_pins=pins)
    assert recipe.name == "python-3.11-bookworm"
    assert (
        "Python 3.11 instead of 3.12 (as near as 3.13, for which the index has no wheel of numpy==1.26.4)"
        in (substitution.differences)
    )
    assert stand_in_for("python:3.12-slim")[0].name == "python-3.13-trixie"  # no pins: the newer
    # A pin both have wheels of decides nothing; a tag naming its suite keeps it whatever the pins.
    assert stand_in_for("python:3.12-slim", python_pins=("idna==3.10",))[0].name == "python-3.13-trixie"
    assert stand_in_for("python:3.12-slim-trixie", python_pins=pins)[0].name == "python-3.13-trixie"


def _audit(*differences: str) -> EnvironmentAudit:
    swap = ImageSubstitution("python:3.12-slim", "localhost/t1jax-stand-in/python-3.13-trixie:x", differences)
    return EnvironmentAudit("t", "container", "img", ("python:3.12-slim",), (swap,))


def test_a_missing_wheel_or_package_under_another_version_is_a_stand_in_gap():
    done = subprocess.run(  # pip's own words for a pin with no wheel for the stand-in's Python
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps", "--only-binary=:all:",
         "--target", "/nonexistent/probe", "--python-version", "3.13", "numpy==1.26.4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    gap = stand_in_gap(_audit("Python 3.13 instead of 3.12"), done.stderr)
    assert gap == (
        "python-3.13-trixie for python:3.12-slim: Python 3.13 instead of 3.12; "
        "pip finds no numpy==1.26.4 for this Python"
    )
    apt = "E: Unable to locate package openjdk-21-jdk-headless"
    assert "apt finds no package openjdk-21-jdk-headless" in stand_in_gap(
        _audit("Debian bookworm instead of jammy"), apt
    )
    assert stand_in_gap(_audit("tmux added for the terminal harness"), apt) is None  # no other version
    assert stand_in_gap(_audit("Python 3.13 instead of 3.12"), "AssertionError: 1 != 2") is None
