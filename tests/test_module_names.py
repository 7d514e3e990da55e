"""Names that say which is which: no two modules of ``src/`` share a file name (``__init__.py``
aside), so a traceback, an editor tab or a ``dvc status`` line naming ``data.py`` names one module.
A section's schema that would take a library module's name is ``<section>_section.py``
(``grpo.config.sections.data_section`` beside ``grpo.data.sources``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .conftest import REPO


def shared_file_names(root: Path) -> dict[str, list[str]]:
    """File names that more than one ``.py`` module under ``root`` has (``__init__.py`` is left
    out), each with its modules' paths relative to ``root``."""
    found = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            found[path.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in found.items() if len(paths) > 1}


def test_no_two_modules_of_src_share_a_file_name():
    assert shared_file_names(REPO / "src") == {}


def test_the_check_sees_a_name_taken_twice(tmp_path):
    for rel in ("lib/one/train.py", "lib/two/train.py", "lib/two/__init__.py", "lib/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert shared_file_names(tmp_path) == {"train.py": ["lib/one/train.py", "lib/two/train.py"]}
