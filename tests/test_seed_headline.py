"""The headline over seeds: written by ``grpo.evaluation.ablations`` from a grid's runs, read by the report of a
run whose settings are one of the grid's variants."""

from __future__ import annotations

import pytest

from grpo.evaluation import ablations, seed_headline
from grpo.evaluation.ablations import Grid
from grpo.evaluation.experiments import Run
from grpo.evaluation.report import build_report


def _runs(vals):
    return [Run(f"{v}-seed-{s}", "x", "success", {}, a) for v, per in vals.items() for s, a in per.items()]


@pytest.fixture
def headline_file(tmp_path):
    """A two-variant grid's headlines written the way ``compare --headline`` writes them."""
    grid = Grid("et1", (0, 1, 2), {"et1": {"train.optimizer.mu": 1}, "et2": {"train.optimizer.mu": 2}},
                decision={"candidates": ["et1", "et2"], "margin": 0.03})
    after = {"et1": {0: 0.40, 1: 0.36, 2: 0.44}, "et2": {0: 0.41, 1: 0.35, 2: 0.45}}
    table = ablations.rows(grid, {ablations.TEST: _runs(after), ablations.SELECT: _runs(after),
                                  ablations.BEFORE: _runs({"et1": {0: 0.09, 1: 0.11, 2: 0.08}}),
                                  ablations.N_EFF_BEFORE: _runs({"et1": {0: 350.0, 1: 190.0, 2: 300.0}}),
                                  ablations.N_EFF_AFTER: _runs({"et2": {0: 220.0, 1: 180.0, 2: 260.0}}),
                                  ablations.ROWS: _runs({"et2": {0: 500.0, 1: 500.0, 2: 500.0}}),
                                  ablations.COST: _runs({"et1": {0: 100.0, 1: 100.0, 2: 100.0},
                                                         "et2": {0: 200.0, 1: 200.0, 2: 200.0}})})
    path = tmp_path / "headline.json"
    ablations.write_headlines(path, "experiments/g.yaml", grid, table)
    return path, ablations.headline(table, "et2")


def test_the_report_words_are_those_of_the_variant_whose_settings_the_run_has(headline_file):
    path, et2 = headline_file
    data = seed_headline.read(path)
    assert data["chosen"] == "et1"  # within the margin and cheaper
    lines = seed_headline.words(data, {"train.optimizer.mu": 2, "train.seed": 5})
    text = " ".join(lines)
    assert "variant **et2**, whose settings this run has" in text and "the default the grid chose" not in text
    assert f"{et2.before.mean:.3f} [{et2.before.low:.3f}, {et2.before.high:.3f}] -> " \
           f"{et2.after.mean:.3f} [{et2.after.low:.3f}, {et2.after.high:.3f}]" in text
    assert "3 seeds (0, 1, 2)" in text and "280 before, 220 after, of 500 rows" in text
    assert "(the default the grid chose)" in " ".join(seed_headline.words(data, {"train.optimizer.mu": 1}))


def test_a_run_the_grid_did_not_run_is_told_so(headline_file, tmp_path):
    path, _ = headline_file
    data = seed_headline.read(path)
    assert seed_headline.matching_variant(data, {"train.optimizer.mu": 3}) is None
    assert "none of the variants of `experiments/g.yaml`" in seed_headline.words(data, {"train.optimizer.mu": 3})[0]
    assert seed_headline.read(tmp_path / "absent.json") is None
    assert "is missing" in seed_headline.words(None, {})[0]


def test_the_report_shows_the_headline_over_seeds_of_its_settings(headline_file, tmp_path):
    path, et2 = headline_file
    root = tmp_path / "ws"
    (root / "experiments" / "results").mkdir(parents=True)
    (root / seed_headline.PATH).write_text(path.read_text())
    (root / "params.yaml").write_text("train:\n  optimizer:\n    mu: 2\n")
    md = build_report(root, tmp_path / "reports").read_text()
    assert "variant **et2**" in md and f"-> {et2.after.mean:.3f} [" in md
    (root / "params.yaml").write_text("train:\n  optimizer:\n    mu: 4\n")
    assert "none of the variants" in build_report(root, tmp_path / "r2").read_text()


def test_a_confirmation_says_which_grid_chose_its_variant(tmp_path):
    """A one-variant grid with ``confirms``: the report names the grid whose decision it confirms and
    that its seeds were never used to choose."""
    grid = Grid("et1", (8, 9), {"et1": {"train.optimizer.mu": 1}}, confirms="experiments/g.yaml")
    after = {"et1": {8: 0.40, 9: 0.36}}
    table = ablations.rows(grid, {ablations.TEST: _runs(after), ablations.SELECT: _runs(after),
                                  ablations.BEFORE: _runs({"et1": {8: 0.09, 9: 0.11}})})
    path = tmp_path / "headline.json"
    ablations.write_headlines(path, "experiments/c.yaml", grid, table)
    text = " ".join(seed_headline.words(seed_headline.read(path), {"train.optimizer.mu": 1}))
    assert "variant **et1** (the default `experiments/g.yaml` chose, on seeds it never saw)" in text
    assert "the grid `experiments/c.yaml`" in text and "2 seeds (8, 9)" in text
