"""The headline on the README and the docs' front pages, written once from the committed record.

Contract: ``render(root)`` is the headline table in markdown, built from the committed record alone:
the grid's headline over seeds (``grpo.evaluation.seed_headline.PATH``: the variant it chose, means over seeds
with their 95% t intervals) and the committed run (``metrics/baseline.json`` and
``metrics/final.json``: the clustered interval the report shows). Each page of ``PAGES`` holds it
between ``BEGIN`` and ``END``; ``python -m grpo.evaluation.headline_pages write`` rewrites those blocks and copies
the committed run's plots into the docs (``PLOTS``), ``check`` exits 1 naming every page or
file that differs (``tests/test_headline_pages.py`` runs it), so no page can drift from the record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grpo.evaluation import seed_headline

PAGES = ("README.md", "docs/index.md", "docs/results.md")
BEGIN = "<!-- headline: python -m grpo.evaluation.headline_pages write (from the committed record; do not edit) -->"
END = "<!-- /headline -->"
PLOTS = (("reports/accuracy.png", "docs/img/accuracy.png"), ("reports/curves.png", "docs/img/curves.png"))
"""The committed run's plots (the report stage's: test accuracy, the training curves) and their copies in the docs."""


def _ci(mean: float, low: float, high: float) -> str:
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def render(root: Path) -> list[str]:
    """The headline table's lines (see the module's contract)."""
    head = seed_headline.read(root / seed_headline.PATH)
    if not head or not head.get("chosen"):
        raise SystemExit(f"headline_pages: {seed_headline.PATH} has no chosen variant")
    name, e = head["chosen"], head["variants"][head["chosen"]]
    b, f = (json.loads((root / "metrics" / f"{s}.json").read_text()) for s in ("baseline", "final"))
    seeds = e["seeds"]
    chosen_by = f" (chosen by `{head['confirms']}`, seeds it never saw)" if head.get("confirms") else ""
    return [
        "| run | before | after |",
        "|---|---|---|",
        f"| {len(seeds)} seed triples ({seeds[0]}-{seeds[-1]}: each draws its own splits, SENT samples and training "
        f"run), `{name}`{chosen_by} of `{head['grid']}` on an {head['cpu']}: mean, 95% t interval across seeds (effective n per seed "
        f"{e['n_eff_before']:.0f} / {e['n_eff_after']:.0f} of {e['rows']:.0f} rows) "
        f"| {_ci(**e['before'])} | **{_ci(**e['after'])}** |",
        f"| the committed run (`dvc.lock`, seed 0; its machine: `reports/report.md`, Run): 95% Wilson at the "
        "effective n, clustered by operand multiset "
        f"({b['effective_n']:.0f} / {f['effective_n']:.0f} of {f['n']} rows) "
        f"| {_ci(b['accuracy'], b['ci_low'], b['ci_high'])} | {_ci(f['accuracy'], f['ci_low'], f['ci_high'])} |",
    ]


def block(root: Path) -> str:
    return "\n".join([BEGIN, *render(root), END])


def _replaced(text: str, new: str, page: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"headline_pages: {page} has no headline block ({BEGIN} ... {END})")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + new + text[end:]


def stale(root: Path) -> list[str]:
    """The pages (and the plots' copies) that differ from what the record writes."""
    new = block(root)
    out = [p for p in PAGES if _replaced((root / p).read_text(), new, p) != (root / p).read_text()]
    for src, dst in PLOTS:
        if not (root / dst).exists() or (root / dst).read_bytes() != (root / src).read_bytes():
            out.append(dst)
    return out


def write(root: Path) -> list[str]:
    """Rewrite every stale page's block and the plots' copies; return what changed."""
    changed = stale(root)
    new = block(root)
    for p in PAGES:
        (root / p).write_text(_replaced((root / p).read_text(), new, p))
    for src, dst in PLOTS:
        (root / dst).write_bytes((root / src).read_bytes())
    return changed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["write"], ["check"]):
        print("usage: python -m grpo.evaluation.headline_pages write|check", file=sys.stderr)
        return 2
    root = Path.cwd()
    if argv == ["write"]:
        print("headline_pages: rewrote " + (", ".join(write(root)) or "nothing (up to date)"))
        return 0
    behind = stale(root)
    if behind:
        print(f"headline_pages: differs from the record: {', '.join(behind)}; run python -m grpo.evaluation.headline_pages write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
