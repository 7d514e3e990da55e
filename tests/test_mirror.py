"""The test files mirror the code they test, so the tests of a module are found by its name:

- ``test_<name>.py``        src/grpo/<layer>/<name>.py (or the package src/grpo/<layer>/<name>/); the
                            layer package (``grpo.tools.code_deps.LAYERS``) is no part of the name
- ``test_<pkg>_<name>.py``  src/grpo/<layer>/<pkg>/<name>.py, a module of a subpackage
- ``test_stage_<name>.py``  tasks/<name>.py, the DVC stage run as ``python -m tasks.<name>``
- ``test_flow_<name>.py``   flows/<name>.py
- ``test_bench_<name>.py``  bench/<name>.py or bench/<name>.sh
- ``test_script_<name>.py`` scripts/<name>.py or scripts/<name>.sh

A test module whose subject is not one file is listed in ``EXCEPTIONS`` with what it tests. Code that
several test modules share lives in conftest.py (fixtures) or helpers.py, never in a test module.

Both ways for the library: every module of src/grpo has its own test file (a subpackage's
``__init__.py`` only when it holds code, and a subpackage may be tested as a whole by
``test_<pkg>.py``: ``PACKAGE_TESTS``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from grpo.tools.code_deps import LAYERS

from .conftest import REPO

TESTS = REPO / "tests"
LAYER_DIRS = [REPO / "src" / "grpo" / layer for layer in LAYERS]

EXCEPTIONS = {
    "test_pipeline.py": "the whole DVC pipeline (dvc.yaml) end to end in a temporary workspace, then the flow over it",
    "test_dvc_graph.py": "dvc.yaml: each stage's code deps are the modules it imports",
    "test_dvc_exp_show.py": "dvc.yaml: `dvc exp show` lists the headline metric only, the documented table fits 200 columns",
    "test_dvc_remote.py": "the DVC remote of .dvc/config: push, pull into a fresh clone, what git keeps",
    "test_presets.py": "presets/*.yaml: each preset's switches run two steps on the CPU",
    "test_cuda.py": "the CUDA paths of several modules on a GPU (`pytest -m cuda`, bench/device_check.py)",
    "test_mirror.py": "this layout",
    "test_docs.py": "README.md, docs/ and mkdocs.yml: every path and module they name exists; the README's size",
    "test_prefect_yaml.py": "prefect.yaml: the deployment it declares equals flows/schedule.yaml",
    "test_flow_operator.py": "flows/pipeline.py, dvc_flow.py, deploy.py and server_auth.py as an operator runs them: a worker "
                             "started by its path, a failed stage's log, a server with an auth string",
    "test_registries.py": "each registry of grpo.config.choices: a toy entry, registered from the test alone, used by a step",
    "test_dvcignore.py": ".dvcignore: importing the code (its __pycache__) leaves every directory dep's hash in dvc.lock "
                         "unchanged",
    "test_module_names.py": "src/: no two modules share a file name",
    "test_layers.py": "src/grpo: every module in a layer package, imports down the layers only, a lazy one with its reason",
}

PACKAGE_TESTS = {"kernels": "test_kernels.py", "sections": "test_sections.py"}
"""Subpackages tested as a whole by one file (the fused kernels against their torch fallbacks; the params
sections, one schema each)."""

PREFIXES = {  # prefix -> (folder, suffixes); the plain test_<name>.py is src/grpo
    "test_stage_": ("tasks", (".py",)),
    "test_flow_": ("flows", (".py",)),
    "test_bench_": ("bench", (".py", ".sh")),
    "test_script_": ("scripts", (".py", ".sh")),
}


def subject(test_file: str) -> list:
    """The files ``test_file`` may mirror (one of them must exist)."""
    stem = test_file.removesuffix(".py")
    for prefix, (folder, suffixes) in PREFIXES.items():
        if stem.startswith(prefix):
            return [REPO / folder / (stem.removeprefix(prefix) + s) for s in suffixes]
    name = stem.removeprefix("test_")
    found = []
    for layer in LAYER_DIRS:
        found += [layer / f"{name}.py", layer / name / "__init__.py"]
        for i, ch in enumerate(name):  # test_<pkg>_<name>.py: src/grpo/<layer>/<pkg>/<name>.py
            if ch == "_" and (layer / name[:i]).is_dir():
                found.append(layer / name[:i] / f"{name[i + 1:]}.py")
    return found


TEST_FILES = sorted(p.name for p in TESTS.glob("test_*.py"))


def test_every_test_file_names_the_module_it_tests():
    unmatched = [f"tests/{name}: no {' or '.join(str(p.relative_to(REPO)) for p in subject(name))}"
                 for name in TEST_FILES if name not in EXCEPTIONS and not any(p.exists() for p in subject(name))]
    assert not unmatched, "rename each after the module it tests, or list it in EXCEPTIONS with what it tests:\n" + \
        "\n".join(unmatched)


def test_every_exception_is_a_test_file_that_mirrors_nothing():
    for name in EXCEPTIONS:
        assert name in TEST_FILES, f"EXCEPTIONS names tests/{name}, which is gone"
        assert not any(p.exists() for p in subject(name)), f"tests/{name} mirrors a module: drop it from EXCEPTIONS"


def test_no_test_module_imports_another():
    for name in TEST_FILES:
        tree = ast.parse((TESTS / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                last = node.module.split(".")[-1]
                assert not last.startswith("test_"), \
                    f"tests/{name} imports {node.module}: shared code goes to tests/conftest.py or tests/helpers.py"


def _holds_code(path) -> bool:
    """Whether a module has more than a docstring."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def test_every_library_module_has_its_own_test_file():
    grpo = REPO / "src" / "grpo"
    missing = []
    for path in sorted(grpo.rglob("*.py")):
        rel = path.relative_to(grpo)
        inner = rel.parts[1:]  # without the layer package
        if path.name == "__init__.py" and (len(inner) < 2 or not _holds_code(path)):
            continue
        if len(inner) > 1 and inner[0] in PACKAGE_TESTS:
            continue
        parts = Path(*inner).with_suffix("").parts
        name = "_".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if f"test_{name}.py" not in TEST_FILES:
            missing.append(f"src/grpo/{rel}: no tests/test_{name}.py")
    assert not missing, "every module gets its own test file:\n" + "\n".join(missing)


def test_package_tests_exist():
    for package, test_file in PACKAGE_TESTS.items():
        assert any((layer / package).is_dir() for layer in LAYER_DIRS) and test_file in TEST_FILES
