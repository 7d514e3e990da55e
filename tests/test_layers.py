"""The library in layers (``grpo.tools.code_deps.LAYERS``): every module lives in one of the packages,
each package says what it holds, and imports run down the layers only; an import inside a function
is the exception, with its reason."""

from __future__ import annotations

import ast
import importlib.util

from grpo.tools.code_deps import LAYERS, Project, import_statements, layer_breaches

from .conftest import REPO

LIBRARY = REPO / "src" / "grpo"


def test_every_module_lives_in_a_layer_package_that_says_what_it_holds():
    assert sorted(p.name for p in LIBRARY.glob("*.py")) == []
    packages = sorted(p.name for p in LIBRARY.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert packages == sorted(LAYERS)
    for name in LAYERS:
        doc = ast.get_docstring(ast.parse((LIBRARY / name / "__init__.py").read_text())) or ""
        assert "May import:" in doc, f"src/grpo/{name}/__init__.py: its docstring does not say what it may import"
        held = sorted(p.name for p in (LIBRARY / name).iterdir()
                      if p.name not in ("__init__.py", "__pycache__") and (p.is_dir() or p.suffix in (".py", ".yaml")))
        unnamed = [h for h in held if h not in doc]
        assert unnamed == [], f"src/grpo/{name}/__init__.py: its docstring does not name {unnamed}"


def test_an_import_inside_a_function_says_why_and_few_do():
    """Every statement importing a grpo module inside a function carries ``# lazy: <reason>`` on its
    line or the line above, and at most 10% of the library's internal imports sit in functions."""
    project = Project(REPO)
    statements = import_statements(project)
    lazy = [key for key, i in statements.items() if i.in_function]
    unsaid = []
    for source, line in lazy:
        lines = source.read_text().splitlines()
        if "# lazy: " not in lines[line - 1] and not lines[line - 2].strip().startswith("# lazy: "):
            unsaid.append(f"{project.relative(source)}:{line}")
    assert unsaid == [], "imports inside functions without a '# lazy: <reason>' comment"
    assert len(lazy) <= 0.10 * len(statements), f"{len(lazy)} of {len(statements)} internal imports inside functions"


def test_imports_run_down_the_layers_only():
    project = Project(REPO)
    breaches = [f"{project.relative(i.source)}:{i.line} -> {project.relative(i.target)} ({i.kind})"
                for i in layer_breaches(project)]
    assert breaches == []


def test_an_import_up_the_layers_is_named(tmp_path):
    """The check can fail: a core module importing a tool, and a lazy one in a function, are both named;
    an import for a type checker alone is not."""
    for name in LAYERS:
        (tmp_path / "src" / "grpo" / name).mkdir(parents=True)
        (tmp_path / "src" / "grpo" / name / "__init__.py").write_text('"""May import: below."""\n')
    (tmp_path / "src/grpo/tools/cli.py").write_text("from grpo.core import errors\n")
    (tmp_path / "src/grpo/core/errors.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "import grpo.tools.cli\nif TYPE_CHECKING:\n    from grpo.training import trainer\n"
        "def f():\n    from grpo.config.params import X\n")
    (tmp_path / "src/grpo/config/params.py").write_text("")
    (tmp_path / "src/grpo/training/trainer.py").write_text("")
    project = Project(tmp_path)
    named = [(project.relative(i.source), i.line, project.relative(i.target)) for i in layer_breaches(project)]
    assert named == [("src/grpo/core/errors.py", 3, "src/grpo/tools/cli.py"),
                     ("src/grpo/core/errors.py", 7, "src/grpo/config/params.py")]


def code_size():
    """scripts/code_size.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("code_size", REPO / "scripts" / "code_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_function_of_the_library_takes_more_than_eight_parameters():
    """What travels together is one record (grpo.core.types) or one component, not a wide signature."""
    assert code_size().wide_signatures(LIBRARY, 8) == []


def test_a_wide_signature_is_named(tmp_path):
    """The check can fail: nine parameters are named, eight and ``self`` are not, ``**kwargs`` counts."""
    (tmp_path / "m.py").write_text("def wide(a, b, c, d, e, f, g, h, i): ...\n"
                                   "class C:\n    def ok(self, a, b, c, d, e, f, g, h): ...\n"
                                   "def kw(a, b, c, d, e, f, g, h, **rest): ...\n")
    assert code_size().wide_signatures(tmp_path, 8) == [(9, f"{tmp_path / 'm.py'}:4 kw"),
                                                        (9, f"{tmp_path / 'm.py'}:1 wide")]
