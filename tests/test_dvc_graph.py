"""dvc.yaml follows from the code: each stage depends on exactly the project files its entry
module imports (transitively, lazy imports included; not those that run only for a type checker or
on the way to an error), and declares every params field it reads. ``grpo.tools.code_deps`` walks the
imports and writes those deps (``python -m grpo.tools.code_deps write``); these tests hold dvc.yaml to it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from grpo.core.dvcfile import read_stages
from grpo.tools.code_deps import Project, main

from .conftest import REPO

PROJECT = Project(REPO)
code_deps = PROJECT.code_deps


def _stages() -> dict:
    return read_stages(REPO / "dvc.yaml")


@pytest.mark.parametrize("stage", list(_stages()))
def test_stage_code_deps_are_its_imports(stage):
    spec = _stages()[stage]
    declared = [d for d in spec.deps if d.startswith(("src/", "tasks/"))]
    expected = PROJECT.stage_code_deps(spec.cmd)
    assert set(declared) == set(expected), (f"{stage}: missing {sorted(set(expected) - set(declared))}, "
                                            f"not imported {sorted(set(declared) - set(expected))} "
                                            "(python -m grpo.tools.code_deps write)")
    assert declared == expected  # the entry module, the other tasks/ files, src/, each sorted


def _workspace_copy(tmp_path: Path) -> Path:
    """dvc.yaml and the code it names (src/grpo, tasks) copied to ``tmp_path``."""
    for folder in ("src/grpo", "tasks"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    return tmp_path


@pytest.mark.parametrize(("stage", "edit", "said"), [
    ("train", ("      - src/grpo/rollout/engine/policy_engine.py\n", ""),
     "train: missing ['src/grpo/rollout/engine/policy_engine.py'], not imported nothing"),
    ("sent", ("      - src/grpo/core/types.py\n", "      - src/grpo/core/types.py\n      - src/grpo/evaluation/report.py\n"),
     "sent: missing nothing, not imported ['src/grpo/evaluation/report.py']"),
])
def test_check_names_a_stale_stage_and_write_restores_the_file(tmp_path, capsys, stage, edit, said):
    """A dep left out or one too many: ``check`` names that stage alone and exits 1; ``write``
    gives back the committed dvc.yaml byte for byte, and ``check`` then exits 0."""
    root = _workspace_copy(tmp_path)
    text = (root / "dvc.yaml").read_text()
    block = text.index(f"\n  {stage}:\n")
    at = text.index(edit[0], block)
    (root / "dvc.yaml").write_text(text[:at] + edit[1] + text[at + len(edit[0]):])
    assert main(["check", "--root", str(root)]) == 1
    assert capsys.readouterr().out.splitlines() == [said]
    assert main(["write", "--root", str(root)]) == 0
    assert (root / "dvc.yaml").read_bytes() == (REPO / "dvc.yaml").read_bytes()
    assert main(["check", "--root", str(root)]) == 0


def test_no_stage_imports_the_deps_writer():
    assert not any(d == "src/grpo/tools/code_deps.py" for spec in _stages().values() for d in spec.deps)


def test_the_walk_sees_lazy_and_package_imports():
    deps = code_deps(REPO / "tasks" / "train.py")
    assert "src/grpo/config/choices.py" in deps  # imported inside a validator of grpo.config.reading
    assert "src/grpo/config/reading.py" in deps and "tasks/_common.py" in deps
    assert "src/grpo/algorithm" in deps and not any(d.startswith("src/grpo/algorithm/") for d in deps)  # all of it
    assert {"src/grpo/rollout/engine/__init__.py", "src/grpo/rollout/engine/policy_engine.py"} <= deps  # file by file:
    assert "src/grpo/rollout/engine/preflight.py" not in deps  # the GPU preflight is no training code


def test_a_registered_choice_is_no_stage_dep_of_its_own():
    """Params validation imports each registry's home by name (``grpo.config.choices``): a registered name
    decides whether params are valid, not what a stage writes, so an edit of, say, the loss re-runs
    the stages that run the loss, not the evaluations. A stage that runs an entry imports it."""
    from grpo.config.choices import REGISTRIES

    homes = {PROJECT.relative(PROJECT.module_file(module)) for module, _ in REGISTRIES.values()}
    assert not homes & code_deps(REPO / "src/grpo/config/choices.py")
    assert not homes & code_deps(REPO / "tasks" / "prepare_model.py")
    train = code_deps(REPO / "tasks" / "train.py")
    assert all(any(home == d or home.startswith(d + "/") for d in train) for home in homes)  # a file, or in a folder


def test_no_registered_entry_imports_the_params_reading():
    """An entry's options are built on ``grpo.core.fields``: what ``grpo.config.choices`` looks up by name never
    imports ``grpo.config.reading`` (the loop config -> choices -> entry -> config of before)."""
    from grpo.config.choices import REGISTRIES

    for module, _ in REGISTRIES.values():
        assert "src/grpo/config/reading.py" not in code_deps(PROJECT.module_file(module)), module
    assert code_deps(REPO / "src/grpo/config/reading.py") == {
        "src/grpo/config/__init__.py", "src/grpo/config/reading.py", "src/grpo/core/__init__.py", "src/grpo/core/errors.py"}


@pytest.mark.parametrize("stage", ["sent", "baseline_eval", "final_eval"])
def test_sampling_stages_depend_on_the_saved_model_sampler_alone(stage):
    """SENT and the evaluations sample saved models: an edit of the training engine (its sync
    strategies, weights forms, 4-bit base, the trainer) re-runs none of them."""
    spec = _stages()[stage]
    engine = {d for d in spec.deps if d.startswith("src/grpo/rollout/engine/")}
    assert engine == {"src/grpo/rollout/engine/__init__.py", "src/grpo/rollout/engine/args.py", "src/grpo/rollout/engine/bounds.py",
                      "src/grpo/rollout/engine/sampler.py"}
    training = {"src/grpo/training/trainer.py", "src/grpo/training/passes.py", "src/grpo/training/rollout_phase.py", "src/grpo/tools/memory.py"}
    assert not training & set(spec.deps)


@pytest.mark.parametrize(("schema", "readers"), [
    ("src/grpo/config/sections/train.py", {"train", "report"}),
    ("src/grpo/config/sections/train_parts.py", {"train", "report"}),
    ("src/grpo/config/sections/shared.py", {"prepare_data", "prepare_model", "sent", "baseline_eval", "train", "final_eval",
                                     "report"}),
    ("src/grpo/config/sections/sent.py", {"sent", "report"}),
    ("src/grpo/config/sections/data_section.py", {"prepare_data", "report"}),
    ("src/grpo/config/sections/evaluate_section.py", {"baseline_eval", "final_eval", "report"}),
])
def test_a_section_schema_is_a_dependency_of_the_stages_that_read_the_section_only(schema, readers):
    """An edit of one section's schema file (a docstring, a default) re-runs the stages that read
    that section, not the whole pipeline: the stages whose deps (following their imports) name it,
    and the guard that validates every section (``Stage.guard``: its output is the same whenever the
    params are valid, so it re-runs nothing downstream)."""
    stages = _stages()
    depends = {name for name, spec in stages.items()
               if any(schema == d or schema.startswith(d.rstrip("/") + "/") for d in spec.deps)}
    guards = {name for name, spec in stages.items() if spec.guard}
    assert guards and depends - guards == readers and guards <= depends


def _sections_served() -> dict[str, set[str]]:
    """Each module of ``grpo.config.sections`` (repo-relative path) -> the params sections whose keys it
    declares: the ``SECTION`` of each section class defined in it, and for a base class with no
    section of its own (``VLLMEngineConfig``) the sections of the classes that inherit from it (a
    part, ``train.rollouts``, serves its section, ``train``)."""
    import importlib
    import inspect
    import pkgutil

    import grpo.config.sections
    from grpo.core.fields import Section

    modules = [importlib.import_module(f"grpo.config.sections.{m.name}") for m in pkgutil.iter_modules(grpo.config.sections.__path__)]
    classes = [c for mod in modules for _, c in inspect.getmembers(mod, inspect.isclass)
               if issubclass(c, Section) and c.__module__ == mod.__name__]
    served = {}
    for mod in modules:
        own = [c for c in classes if c.__module__ == mod.__name__]
        served[str(Path(mod.__file__).relative_to(REPO))] = {
            c.SECTION.split(".")[0] for c in classes if c.SECTION and any(issubclass(c, base) for base in own)}
    return served


def section_leaks(stages: dict) -> dict[str, list[str]]:
    """Per stage, the section modules among its deps whose sections it reads no key of (its
    ``params:`` name neither the section nor one of its keys): an edit of such a module would re-run
    the stage for nothing."""
    served, leaks = _sections_served(), {}
    for name, spec in stages.items():
        if spec.all_params:  # `- params.yaml:`: the stage reads every section
            continue
        reads = {p.split(".")[0] for p in spec.params}
        modules = {m for d in spec.deps for m in served if m == d or m.startswith(d.rstrip("/") + "/")}
        wasted = sorted(m for m in modules if not served[m] & reads)
        if wasted:
            leaks[name] = wasted
    return leaks


def test_a_stage_depends_on_no_section_module_whose_keys_it_does_not_read():
    assert section_leaks(_stages()) == {}


def test_the_leak_check_names_a_section_a_stage_does_not_read():
    """The lora section as a dep of SENT (through ``grpo.model.lora_policy``, before it imported the
    section for type checking only): SENT reads no ``lora.*`` key."""
    sent = _stages()["sent"]
    leaked = type(sent)(deps=(*sent.deps, "src/grpo/config/sections/lora.py"), params=sent.params)
    assert section_leaks({"sent": leaked}) == {"sent": ["src/grpo/config/sections/lora.py"]}
