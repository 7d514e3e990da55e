"""grpo.tools.code_deps on a small workspace of its own: which imports count, how ``write`` edits
dvc.yaml (the code deps alone, in place), what ``check`` says, and the graph's figures."""

from __future__ import annotations

import textwrap
from pathlib import Path

from grpo.tools.code_deps import Project, graph_report, main

FILES = {
    "src/grpo/a.py": """
        from typing import TYPE_CHECKING

        import grpo.b

        if TYPE_CHECKING:
            from grpo.d import D


        def run():
            from grpo.c import C

            try:
                return C
            except ValueError:
                from grpo.e import wording

                raise RuntimeError(wording())
        """,
    "src/grpo/b.py": "B = 1\n",
    "src/grpo/c.py": "C = 1\n",
    "src/grpo/d.py": "D = 1\n",
    "src/grpo/e.py": "def wording():\n    return ''\n",
    "src/grpo/pkg/__init__.py": "",
    "src/grpo/pkg/m.py": "M = 1\n",
    "src/grpo/pkg/n.py": "N = 1\n",
    "tasks/__init__.py": "",
    "tasks/_shared.py": "",
    "tasks/run.py": "import grpo.a\nimport tasks._shared\nfrom grpo.pkg import m\n",
}
DVC_YAML = """\
# a comment the writer leaves alone
stages:
  run:
    cmd: python -m tasks.run
    deps:
      - data/in.txt
      - src/grpo/zzz.py
      - tasks/run.py  # the entry
      - data/other.txt:
          cache: false
    params:
      - x
  plain:
    cmd: echo hello
    deps:
      - src/grpo/zzz.py

plots:
  - a.png
"""
WRITTEN = DVC_YAML.replace("""      - src/grpo/zzz.py
      - tasks/run.py  # the entry
""", """      - tasks/run.py  # the entry
      - tasks/_shared.py
      - src/grpo/a.py
      - src/grpo/b.py
      - src/grpo/c.py
      - src/grpo/pkg/__init__.py
      - src/grpo/pkg/m.py
""")


def _workspace(root: Path, files: dict[str, str] = FILES) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    (root / "dvc.yaml").write_text(DVC_YAML)
    return root


def test_a_stage_depends_on_what_runs_not_on_type_checking_or_error_wording(tmp_path):
    root = _workspace(tmp_path)
    assert Project(root).stage_code_deps("python -m tasks.run --params params.yaml") == [
        "tasks/run.py", "tasks/_shared.py", "src/grpo/a.py", "src/grpo/b.py", "src/grpo/c.py",
        "src/grpo/pkg/__init__.py", "src/grpo/pkg/m.py"]
    assert Project(root).stage_code_deps("echo hello") is None


def test_a_subpackage_reached_whole_is_named_by_its_folder(tmp_path):
    root = _workspace(tmp_path, {**FILES, "tasks/run.py": FILES["tasks/run.py"] + "import grpo.pkg.n\n"})
    deps = Project(root).code_deps(root / "tasks" / "run.py")
    assert "src/grpo/pkg" in deps and not any(d.startswith("src/grpo/pkg/") for d in deps)


def test_write_replaces_the_code_deps_in_place_and_nothing_else(tmp_path, capsys):
    root = _workspace(tmp_path)
    assert main(["check", "--root", str(root)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "run: missing ['src/grpo/a.py', 'src/grpo/b.py', 'src/grpo/c.py', 'src/grpo/pkg/__init__.py', "
        "'src/grpo/pkg/m.py', 'tasks/_shared.py'], not imported ['src/grpo/zzz.py']"]
    assert main(["write", "--root", str(root)]) == 0
    assert (root / "dvc.yaml").read_text() == WRITTEN
    assert main(["check", "--root", str(root)]) == 0
    assert main(["write", "--root", str(root)]) == 0 and (root / "dvc.yaml").read_text() == WRITTEN


def test_check_names_code_deps_out_of_order(tmp_path, capsys):
    root = _workspace(tmp_path)
    (root / "dvc.yaml").write_text(WRITTEN.replace("      - src/grpo/a.py\n      - src/grpo/b.py\n",
                                                   "      - src/grpo/b.py\n      - src/grpo/a.py\n"))
    assert main(["check", "--root", str(root)]) == 1
    assert "run: code deps out of order" in capsys.readouterr().out


def test_the_graph_counts_lazy_imports_and_names_a_cycle_through_importlib(tmp_path):
    """``reg`` names ``grpo.a`` to importlib in a table, and ``a`` imports ``reg`` in a function:
    one cycle, whose two imports run back up (``a`` is above ``b``, ``reg`` imports nothing)."""
    files = {**FILES, "src/grpo/reg.py": "import importlib\n\nTABLE = {'x': ('grpo.a', 'A')}\n\n\n"
                                        "def get(key):\n    return importlib.import_module(TABLE[key][0])\n",
             "src/grpo/c.py": "def f():\n    import grpo.reg\n"}
    lines = graph_report(Project(_workspace(tmp_path, files)))
    assert lines[0] == "src/grpo: 6 top-level modules, 1 packages (pkg 3 modules)"
    assert lines[1].startswith("internal imports (statements naming a grpo module): 5, 3 inside functions (60%); "
                               "of all, 2 run when a function is called, 1 only on the way to a raise, "
                               "1 only for a type checker")
    assert lines[2].startswith("levels: 2 ") and lines[2].endswith("module-level cycles: 0): grpo.a -> grpo.b")
    assert lines[3].endswith(": 1") and "grpo.a, grpo.c, grpo.reg" in lines[4]
    assert any("src/grpo/reg.py:3 -> grpo.a (importlib" in line for line in lines)
