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


def _packages(path: Path) -> list[Path]:
    """The ``__init__.py`` of every subpackage of ``grpo`` that holds ``path`` (Python runs each
    when it imports a module inside)."""
    inits = []
    for parent in path.parents:
        if parent == ROOTS["grpo"] or ROOTS["grpo"] not in parent.parents:
            break
        inits.append(parent / "__init__.py")
    return [p for p in inits if p.exists()]


def code_deps(entry: Path) -> set[str]:
    """Repo-relative files reached from ``entry``: a module of a subpackage brings the package's
    ``__init__.py``, not its other modules; a subpackage all of whose modules are reached is
    named by its directory."""
    seen, todo = set(), [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [_module_file(m) for m in _imports(path)] + _packages(path)
    for package in {p.parent for p in seen if p.name == "__init__.py"}:
        if set(package.glob("*.py")) <= seen:
            seen = {p for p in seen if p.parent != package} | {package}
    return {str(path.relative_to(REPO)) for path in seen} - {"tasks/__init__.py"}


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
    assert "src/grpo/choices.py" in deps  # imported inside a validator of grpo.config
    assert "src/grpo/config.py" in deps and "tasks/_common.py" in deps
    assert "src/grpo/kernels" in deps and not any(d.startswith("src/grpo/kernels/") for d in deps)  # all of it
    assert {"src/grpo/engine/__init__.py", "src/grpo/engine/policy_engine.py"} <= deps  # file by file:
    assert "src/grpo/engine/preflight.py" not in deps  # the GPU preflight is no training code


def test_a_registered_choice_is_no_stage_dep_of_its_own():
    """Params validation imports each registry's home by name (``grpo.choices``): a registered name
    decides whether params are valid, not what a stage writes, so an edit of, say, the loss re-runs
    the stages that run the loss, not the evaluations. A stage that runs an entry imports it."""
    from grpo.choices import REGISTRIES

    homes = {str(_module_file(module).relative_to(REPO)) for module, _ in REGISTRIES.values()}
    assert not homes & code_deps(REPO / "src" / "grpo" / "choices.py")
    assert not homes & code_deps(REPO / "tasks" / "prepare_model.py")
    assert homes <= code_deps(REPO / "tasks" / "train.py")


@pytest.mark.parametrize("stage", ["sent", "baseline_eval", "final_eval"])
def test_sampling_stages_depend_on_the_saved_model_sampler_alone(stage):
    """SENT and the evaluations sample saved models: an edit of the training engine (its sync
    strategies, weights forms, 4-bit base, the trainer) re-runs none of them."""
    spec = _stages()[stage]
    engine = {d for d in spec.deps if d.startswith("src/grpo/engine/")}
    assert engine == {"src/grpo/engine/__init__.py", "src/grpo/engine/args.py", "src/grpo/engine/bounds.py",
                      "src/grpo/engine/sampler.py"}
    training = {"src/grpo/trainer.py", "src/grpo/passes.py", "src/grpo/rollout_phase.py", "src/grpo/memory.py"}
    assert not training & set(spec.deps)


@pytest.mark.parametrize(("schema", "readers"), [
    ("src/grpo/sections/train.py", {"train", "final_eval", "report"}),
    ("src/grpo/sections/sent.py", {"sent", "report"}),
    ("src/grpo/sections/data_section.py", {"prepare_data", "report"}),
    ("src/grpo/sections/evaluate_section.py", {"baseline_eval", "final_eval", "report"}),
])
def test_a_section_schema_is_a_dependency_of_the_stages_that_read_the_section_only(schema, readers):
    """An edit of one section's schema file (a docstring, a default) re-runs the stages that read
    that section, not the whole pipeline: the stages whose deps (following their imports) name it."""
    stages = _stages()
    depends = {name for name, spec in stages.items()
               if any(schema == d or schema.startswith(d.rstrip("/") + "/") for d in spec.deps)}
    assert depends == readers
