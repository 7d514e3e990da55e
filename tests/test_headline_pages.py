"""grpo.evaluation.headline_pages: the README and the docs' front pages carry the committed record's headline."""

import json
import shutil
from pathlib import Path

from grpo.evaluation import headline_pages, seed_headline

REPO = Path(__file__).resolve().parents[1]


def copy_of_the_record(tmp: Path) -> Path:
    for rel in (*headline_pages.PAGES, *(f for pair in headline_pages.PLOTS for f in pair), seed_headline.PATH, "metrics/baseline.json",
                "metrics/final.json"):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp / rel)
    return tmp


def test_every_page_carries_the_headline_the_committed_record_writes():
    assert headline_pages.stale(REPO) == [], "run: python -m grpo.evaluation.headline_pages write"
    for page in headline_pages.PAGES:
        assert "\n".join(headline_pages.render(REPO)) in (REPO / page).read_text(), page


def test_a_hand_edited_figure_or_a_new_record_makes_the_pages_stale(tmp_path):
    root = copy_of_the_record(tmp_path)
    page = root / "docs/index.md"
    after = json.loads((root / "metrics/final.json").read_text())["accuracy"]
    page.write_text(page.read_text().replace(f"{after:.3f} [", "0.999 ["))
    assert headline_pages.stale(root) == ["docs/index.md"]
    final = json.loads((root / "metrics/final.json").read_text())
    (root / "metrics/final.json").write_text(json.dumps({**final, "accuracy": final["accuracy"] + 0.01}))
    assert set(headline_pages.stale(root)) == set(headline_pages.PAGES)
    headline_pages.write(root)
    assert headline_pages.stale(root) == [] and f"{final['accuracy'] + 0.01:.3f} [" in page.read_text()


def test_a_plot_copy_that_differs_from_the_reports_is_stale(tmp_path):
    root = copy_of_the_record(tmp_path)
    for _, dst in headline_pages.PLOTS:
        (root / dst).write_bytes(b"an older plot")
    assert headline_pages.stale(root) == [dst for _, dst in headline_pages.PLOTS]
    headline_pages.write(root)
    assert headline_pages.stale(root) == []
