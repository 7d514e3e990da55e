"""The docs name only what exists, and the README stays a newcomer's page.

Scanned: README.md, every page under docs/, mkdocs.yml, and the comments of params.yaml and the
presets. A repository path (``src/...``, ``tasks/...``, ``tests/...``, ``bench/...``, ...) must be a
file or folder of the repository, and a module (``grpo.x``, ``tasks.x``) a module or package of it.
Links between pages, their anchors and included files are checked by ``mkdocs build --strict``
(scripts/test.sh).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import REPO

README_MAX_LINES = 260
TOP_DIRS = ("src", "tasks", "tests", "bench", "flows", "scripts", "configs", "presets", "docs")
# a repository path: a top folder, a slash, then a name ending in a word character (not a placeholder
# such as tasks/<stage>.py, whose match stops at the "<")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP_DIRS)})/[\w./-]*\w)(?![\w<])")
MODULE = re.compile(r"(?<![\w./-])((?:grpo|tasks)(?:\.[a-z_][a-z0-9_]*)+)")

# What a how-to creates as its worked example, allowed on that page only.
EXAMPLES = {"docs/howto/add-a-stage.md": {"tasks/gain.py", "tasks.gain"},
            "docs/howto/add-a-rollout-engine.md": {"src/grpo/rollout/hf_generate.py", "grpo.rollout.hf_generate",
                                                   "tests/test_hf_generate.py"},
            "docs/howto/add-a-weights-form.md": {"src/grpo/rollout/engine/dense_lora_form.py",
                                                 "tests/test_engine_dense_lora_form.py"}}


def doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "mkdocs.yml", REPO / "params.yaml"]
    files += sorted((REPO / "docs").rglob("*.md")) + sorted((REPO / "presets").glob("*.yaml"))
    return files


def text_of(path: Path) -> str:
    """A markdown or mkdocs file whole; of a params file only its comments (values are not prose)."""
    text = path.read_text()
    if path.name == "mkdocs.yml" or path.suffix == ".md":
        return text
    return "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)


def module_exists(name: str) -> bool:
    """Whether ``name`` is a module or package of the project, or a lower-case name inside a module
    (``grpo.model.lora_policy.export_dense``): the dotted parts resolve through packages to a module,
    and what follows a module is an attribute."""
    top, *parts = name.split(".")
    base = REPO / "src" / "grpo" if top == "grpo" else REPO / "tasks"
    for part in parts:
        if (base / part).with_suffix(".py").is_file():
            return True
        if not (base / part / "__init__.py").is_file():
            return False
        base = base / part
    return True


def undated(text: str) -> str:
    """The lab notebook without its dated entries (``## 2026-...`` to the next ``## ``): they record
    what existed then, and a file removed since stays named there."""
    sections = re.split(r"(?m)^(?=## )", text)
    return "".join(s for s in sections if not re.match(r"## \d{4}-", s))


GIT_SHOW = re.compile(r"git show [0-9a-f]{7,40}\^?:\S+")
"""``git show REV:path``: a file as it was at REV (a removed bench's rerun), not one the tree holds."""


def mentions() -> list[tuple[str, str, bool]]:
    """(file, name, exists) for every path and module the docs mention (the lab notebook's dated
    entries and ``git show REV:path`` left out)."""
    out = []
    for path in doc_files():
        rel = str(path.relative_to(REPO))
        text = GIT_SHOW.sub("", text_of(path))
        if path.name == "lab-notebook.md":
            text = undated(text)
        out += [(rel, m, (REPO / m).exists()) for m in PATH.findall(text)]
        out += [(rel, m, module_exists(m)) for m in MODULE.findall(text)]
    return out


def test_the_scan_finds_paths_and_modules_and_spots_a_missing_one():
    found = {name for _, name, _ in mentions()}
    assert {"src/grpo/training/trainer.py", "tests/test_dvc_graph.py", "grpo.evaluation.experiments", "tasks.train"} <= found
    assert PATH.findall("see tasks/<stage>.py and `src/grpo/models.py`.") == ["src/grpo/models.py"]
    assert MODULE.findall("loaded through grpo.models, or python -m tasks.<stage>") == ["grpo.models"]
    assert not PATH.findall(GIT_SHOW.sub("", "rerun: `git show 5e80033^:bench/gone.py`"))
    assert not module_exists("grpo.models") and module_exists("grpo.algorithm.kernels") and module_exists("tasks._common")
    assert module_exists("grpo.model.lora_policy.export_dense") and not module_exists("grpo.training.trainerr")


def test_every_path_and_module_the_docs_name_exists():
    missing = sorted({f"{file}: {name}" for file, name, exists in mentions()
                      if not exists and name not in EXAMPLES.get(file, ())})
    assert not missing, "the docs name what does not exist:\n" + "\n".join(missing)


def test_readme_fits_a_screen_and_links_onward():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for page in ("docs/results.md", "docs/benchmarks.md", "docs/scaling-out.md", "docs/orchestration.md",
                 "docs/gpu-notes.md", "docs/troubleshooting.md"):
        assert f"]({page})" in readme, page


@pytest.mark.parametrize("page", sorted(p.name for p in (REPO / "docs").rglob("*.md")))
def test_every_page_is_in_the_nav(page):
    assert page in (REPO / "mkdocs.yml").read_text()


POINTER = re.compile(r"(?<![\w./-])(docs/[\w/-]+\.md)((?:#[\w-]+)?)((?:,?\s+(?:and\s+)?#[\w-]+)*)")


def heading_anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives the page's headings (lower case, words joined by hyphens, other
    punctuation dropped)."""
    anchors = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
            anchors.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title)).strip("-"))
    return anchors


def code_pointers() -> list[tuple[str, str, str]]:
    """(file, page, anchor or "") for every pointer from the code (src/, tasks/, bench/, flows/,
    scripts/) to a docs page: ``docs/page.md``, ``docs/page.md#anchor``, and ``, #more`` after it."""
    out = []
    for folder in ("src", "tasks", "bench", "flows", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text()
            for page, first, more in POINTER.findall(text):
                anchors = [first.lstrip("#")] if first else [""]
                anchors += re.findall(r"#([\w-]+)", more)
                out += [(str(path.relative_to(REPO)), page, a) for a in anchors]
    return out


def test_pointers_from_the_code_to_the_docs_resolve():
    pointers = code_pointers()
    assert any(a == "shutdown" for _, _, a in pointers)  # the scan sees the vLLM source map's pointers
    broken = []
    for file, page, anchor in pointers:
        target = REPO / page
        if not target.is_file():
            broken.append(f"{file}: {page} does not exist")
        elif anchor and anchor not in heading_anchors(target):
            broken.append(f"{file}: {page}#{anchor}: no such heading")
    assert not broken, "\n".join(broken)


def test_the_vllm_source_map_is_the_one_home_of_vllm_line_numbers():
    """Line numbers of vLLM's source live in docs/gpu-notes.md; the code points there."""
    cited = re.compile(r"\b(?:v1|lora|config|distributed|device_allocator|model_executor|platforms|engine|utils)/"
                       r"[\w/]+\.py:\d+")
    found = [f"{p.relative_to(REPO)}: {m}" for folder in ("src", "tasks")
             for p in sorted((REPO / folder).rglob("*.py")) for m in cited.findall(p.read_text())]
    assert not found, "\n".join(found)


def test_named_tests_exist():
    """``tests/test_x.py::test_name`` in the docs names a test function of that file (renamed or
    moved tests leave no stale pointer; the lab notebook's dated entries name what was then)."""
    named = re.compile(r"(tests/test_\w+\.py)::(test_\w+)")
    missing = []
    for path in doc_files():
        if path.name == "lab-notebook.md":
            continue
        for file, name in named.findall(text_of(path)):
            target = REPO / file
            if not target.is_file() or f"def {name}(" not in target.read_text():
                missing.append(f"{path.relative_to(REPO)}: {file}::{name}")
    assert not missing, "\n".join(missing)
