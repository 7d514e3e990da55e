"""dvc.yaml follows from the code: each stage depends on exactly the project files its entry
module imports (transitively, lazy imports included), and declares every params field it reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from grpo.dvcfile import read_stages

from .conftest import REPO

ROOTS = {"grpo": REPO / "src" / "grpo", "tasks": REPO / "tasks"}


def _module_file(name: str) -> Path | None:
    """The file of a project module (``grpo.x`` or ``tasks.x``), or None for anything else."""
    top, _, rest = name.partition(".")
    if top not in ROOTS or not rest:
        return None
    base = ROOTS[top].joinpath(*rest.split("."))
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    return None


def _imports(path: Path) -> set[str]:
    """Project modules imported anywhere in ``path`` (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from grpo import x`
    return {m for m in found if _module_file(m) is not None}


def code_deps(entry: Path) -> set[str]:
    """Repo-relative files reached from ``entry``; a package directory stands for its files."""
    seen, todo = set(), [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [_module_file(m) for m in _imports(path)]
        if path.name == "__init__.py":  # a package: every module in it
            todo += list(path.parent.glob("*.py"))
    out = set()
    for path in seen:
        rel = path.relative_to(REPO)
        if path.parent != ROOTS["grpo"] and path.parent.parent == ROOTS["grpo"]:
            out.add(str(rel.parent))  # src/grpo/<package>
        elif rel != Path("tasks/__init__.py"):
            out.add(str(rel))
    return out


def _stages() -> dict:
    return read_stages(REPO / "dvc.yaml")


@pytest.mark.parametrize("stage", list(_stages()))
def test_stage_code_deps_are_its_imports(stage):
    spec = _stages()[stage]
    entry = REPO / "tasks" / f"{spec.cmd.split('tasks.')[1].split()[0]}.py"
    declared = {d for d in spec.deps if d.startswith(("src/", "tasks/"))}
    expected = code_deps(entry)
    assert declared == expected, (f"{stage}: missing {sorted(expected - declared)}, "
                                  f"not imported {sorted(declared - expected)}")


def test_the_walk_sees_lazy_and_package_imports():
    deps = code_deps(REPO / "tasks" / "train.py")
    assert "src/grpo/rewards.py" in deps  # imported inside a validator of grpo.config
    assert "src/grpo/kernels" in deps and "src/grpo/config.py" in deps
    assert not any(d.startswith("src/grpo/kernels/") for d in deps)
    assert "tasks/_common.py" in deps
