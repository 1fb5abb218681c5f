"""The import arrows of docs/design.md "Architecture": every import in t1jax/ and sandbox_service/
(function-level ones too), read from the source, points down the allowed table. A new arrow fails
here until the table (and the design) says why it exists."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# stdlib / yaml only; t1jax.launch_params is the run config's `launch:` section, read by both the
# configuration tree (controller) and the manifest renderer (launch)
LEAVES = {"t1jax.yamlio", "t1jax.host_devices", "t1jax.compilation_cache", "t1jax.launch_params"}
# package -> the t1jax packages it may import (besides itself and the leaves); sandbox_service is
# below every t1jax package and imports none.
ALLOWED = {
    "t1jax.ops": set(),
    "t1jax.model": {"t1jax.ops"},
    "t1jax.parallel": {"t1jax.model", "t1jax.ops"},
    "t1jax.rollout": {"t1jax.model", "t1jax.parallel"},
    "t1jax.tito": {"t1jax.rollout"},
    "t1jax.agent": {"t1jax.rollout", "t1jax.tito"},
    "t1jax.checkpoints": {"t1jax.model", "t1jax.agent"},
    "t1jax.rl": {"t1jax.model", "t1jax.ops", "t1jax.parallel", "t1jax.tito"},
    "t1jax.runtime": {"t1jax.agent", "t1jax.rl", "t1jax.rollout", "t1jax.tito"},
    "t1jax.data": set(),
    "t1jax.harbor": {"t1jax.tito", "t1jax.rollout", "t1jax.runtime", "t1jax.agent"},
    "t1jax.eval": {"t1jax.agent", "t1jax.checkpoints", "t1jax.data", "t1jax.harbor", "t1jax.rl",
                   "t1jax.rollout", "t1jax.runtime", "t1jax.tito", "t1jax.model"},
    "t1jax.controller": {"t1jax.agent", "t1jax.checkpoints", "t1jax.data", "t1jax.harbor", "t1jax.model",
                         "t1jax.parallel", "t1jax.rl", "t1jax.rollout", "t1jax.runtime"},
    "t1jax.tools": {"t1jax.model", "t1jax.ops", "t1jax.parallel", "t1jax.rl", "t1jax.rollout"},
    "t1jax.sft": {"t1jax.agent", "t1jax.controller", "t1jax.data", "t1jax.model", "t1jax.rl",
                  "t1jax.rollout", "t1jax.tito"},
    "t1jax.report": {"t1jax.controller"},
    "t1jax.launch": {"t1jax.controller", "t1jax.model", "t1jax.parallel", "t1jax.tools"},
    "t1jax.demo": {"t1jax.cli", "t1jax.controller", "t1jax.eval", "t1jax.model", "t1jax.report",
                   "t1jax.sft"},
    "t1jax.cli": set(),
}  # fmt: skip
# Arrows the design forbids even if the table were edited to allow them: the configuration and
# the training loop live below deployment (`launch`) and evaluation (`eval`), which import them.
FORBIDDEN = {("t1jax.controller", "t1jax.launch"), ("t1jax.controller", "t1jax.eval")}


def _package(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[0] == "sandbox_service":
        return "sandbox_service"
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("t1jax", "sandbox_service"):  # from t1jax import compilation_cache
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
            else:
                yield node.module


def _arrows() -> set[tuple[str, str, str]]:
    """(importing package, imported package, importing file) for every cross-package import."""
    arrows = set()
    for root in ("t1jax", "sandbox_service"):
        for path in sorted((REPO / root).rglob("*.py")):
            source = _package(path)
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] not in ("t1jax", "sandbox_service"):
                    continue
                target = "sandbox_service" if parts[0] == "sandbox_service" else ".".join(parts[:2])
                if target != source:
                    arrows.add((source, target, str(path.relative_to(REPO))))
    return arrows


def test_every_import_points_down_the_table():
    wrong = defaultdict(list)
    for source, target, where in sorted(_arrows()):
        if target in LEAVES:
            continue
        if source == "sandbox_service":
            wrong[source].append(f"{target} ({where})")  # never imports t1jax
        elif target != "sandbox_service" and target not in ALLOWED.get(source, set()):
            wrong[source].append(f"{target} ({where})")
    assert not wrong, dict(wrong)


def test_the_table_names_every_package():
    packages = {_package(p) for p in (REPO / "t1jax").rglob("*.py")} - LEAVES - {"t1jax.__init__"}
    assert packages <= set(ALLOWED), sorted(packages - set(ALLOWED))


def test_leaves_import_no_t1jax_package():
    for leaf in LEAVES:
        path = REPO / Path(*leaf.split(".")).with_suffix(".py")
        assert path.is_file(), leaf
        inside = [name for name in _imports(path) if name.split(".")[0] in ("t1jax", "sandbox_service")]
        assert not inside, (leaf, inside)


def test_controller_imports_neither_launch_nor_eval():
    for source, target in FORBIDDEN:
        assert target not in ALLOWED[source], f"the table allows {source} -> {target}"
        found = sorted(where for s, t, where in _arrows() if (s, t) == (source, target))
        assert not found, f"{source} -> {target}: {found}"


def test_the_table_has_no_cycle():
    # Every allowed arrow points down: a depth-first walk never meets a package on its own path.
    state: dict[str, str] = {}

    def visit(package: str, path: tuple[str, ...]) -> None:
        if state.get(package) == "done":
            return
        assert state.get(package) != "open", " -> ".join((*path, package))
        state[package] = "open"
        for target in sorted(ALLOWED.get(package, ())):
            visit(target, (*path, package))
        state[package] = "done"

    for package in sorted(ALLOWED):
        visit(package, ())
