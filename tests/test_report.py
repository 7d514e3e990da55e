"""The run report: smoothing, what the plots draw, and what ``build_report`` writes from a
fabricated workspace (metrics, the dvclive per-step tables, evaluation records, the SENT cache).

Figures are captured when they are saved (``Figure.savefig`` is wrapped), so the tests read the
plotted data back from the matplotlib artists instead of looking at pixels.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from PIL import Image

from grpo.report import build_report, moving_average, plot_curves, read_step_metrics


def trailing_mean(values, window):
    """Independent reference: mean of the last ``window`` values (all of them at the start)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]


@pytest.fixture
def figures(monkeypatch):
    """File name -> the Figure saved to it (the file is still written)."""
    saved: dict[str, Figure] = {}
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        saved[Path(fname).name] = self
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_moving_average_is_a_trailing_mean():
    # window 2: [1], [1, 3], [3, 5], [5, 7]
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 5) == [2.0, 3.0]
    assert moving_average([], 3) == []


@pytest.mark.parametrize("window", [1, 2, 3, 5, 20])
def test_moving_average_matches_reference(window):
    values = [math.sin(i) + 0.1 * i for i in range(17)]
    assert moving_average(values, window) == pytest.approx(trailing_mean(values, window))


# ---------------------------------------------------------------- plot_curves -------------------

STAGES = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3]
BOUNDARIES = [3.5, 5.5, 10.5]  # between the last step of one stage and the first of the next


def make_steps(same: bool) -> list[dict]:
    steps = []
    for i, stage in enumerate(STAGES):
        acc = round(0.1 + 0.05 * i + 0.1 * math.sin(3 * i), 4)
        steps.append({"step": i + 1, "stage": stage, "accuracy": acc,
                      "reward_mean": acc if same else round(acc + 0.2 + 0.03 * math.cos(i), 4)})
    return steps


def curve_lines(fig: Figure, steps: list[dict]):
    """(raw lines, smoothed lines, x of the vertical lines) of the single-axes curve figure."""
    (ax,) = fig.axes
    x = [r["step"] for r in steps]
    data = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == x]
    vertical = [ln for ln in ax.get_lines() if ln not in data]
    assert all(len(set(ln.get_xdata())) == 1 for ln in vertical)
    smoothed = [ln for ln in data if not ln.get_label().startswith("_")]  # the legend entries
    raw = [ln for ln in data if ln not in smoothed]
    return raw, smoothed, sorted(float(ln.get_xdata()[0]) for ln in vertical)


@pytest.mark.parametrize("window", [3, 5])
def test_curves_plot_raw_and_smoothed_reward_and_accuracy(tmp_path, figures, window):
    steps = make_steps(same=False)
    plot_curves(steps, tmp_path / "curves.png", window=window)
    raw, smoothed, vlines = curve_lines(figures["curves.png"], steps)

    series = {"reward": [r["reward_mean"] for r in steps], "accuracy": [r["accuracy"] for r in steps]}
    assert sorted(list(ln.get_ydata()) for ln in raw) == sorted(series.values())
    assert len(smoothed) == 2
    for line in smoothed:
        (partner,) = [r for r in raw if r.get_color() == line.get_color()]  # its raw series
        assert list(line.get_ydata()) == pytest.approx(trailing_mean(list(partner.get_ydata()), window))
        assert f"{window}-step" in line.get_label()
    assert {smoothed[0].get_color(), smoothed[1].get_color()} == {r.get_color() for r in raw}
    assert vlines == BOUNDARIES
    assert Image.open(tmp_path / "curves.png").format == "PNG"


def test_curves_draw_one_pair_when_reward_is_accuracy(tmp_path, figures):
    steps = make_steps(same=True)
    plot_curves(steps, tmp_path / "curves.png")
    raw, smoothed, vlines = curve_lines(figures["curves.png"], steps)
    accuracy = [r["accuracy"] for r in steps]
    assert [list(ln.get_ydata()) for ln in raw] == [accuracy]
    assert [list(ln.get_ydata()) for ln in smoothed] == [pytest.approx(trailing_mean(accuracy, 5))]
    assert vlines == BOUNDARIES


def test_curves_without_stage_changes_have_no_boundaries(tmp_path, figures):
    steps = make_steps(same=False)
    for r in steps:
        r["stage"] = 0
    plot_curves(steps, tmp_path / "a.png")
    assert curve_lines(figures["a.png"], steps)[2] == []
    for r in steps:
        del r["stage"]
    plot_curves(steps, tmp_path / "b.png")
    assert curve_lines(figures["b.png"], steps)[2] == []


# ---------------------------------------------------------------- build_report ------------------

BASELINE = {"accuracy": 0.3, "accuracy_ci95_low": 0.21, "accuracy_ci95_high": 0.41, "format_rate": 0.1, "n": 60,
            "weights": "base weights", "backend": "hf"}
FINAL = {"accuracy": 0.45, "accuracy_ci95_low": 0.33, "accuracy_ci95_high": 0.58, "format_rate": 0.8, "n": 60,
         "weights": "merged LoRA", "backend": "vllm"}
TRAIN = {"steps": 12, "final_accuracy": 0.4375, "total_time_s": 123.456}
SENT = {"rows": 8, "num_samples": 4, "backend": "hf", "generate_s": 12.3, "tokens_per_s": 456.7,
        "entropy_mean": 0.6931, "zero_entropy_frac": 0.25}
ENTROPIES = [0.0, 0.0, 0.3, 0.5, 0.69, 0.9, 1.1, 1.38]
SIGNALS = {"entropy_mean": "token entropy", "kl": "KL", "kept_frac": "kept-token", "completion_len": "completion length"}
# (id, baseline correct, final correct); p6 has no baseline record
EVAL = [("p1", False, True), ("p2", True, True), ("p3", True, False), ("p4", False, False), ("p5", False, True)]


def write_tsv(path: Path, key: str, values: list[float], timestamp: bool = False) -> None:
    head = ["timestamp"] * timestamp + ["step", key]
    rows = [[str(1_700_000_000 + i)] * timestamp + [str(i + 1), repr(v)] for i, v in enumerate(values)]
    path.write_text("\n".join("\t".join(r) for r in [head, *rows]) + "\n")


def eval_record(pid: str, correct: bool, stage: str) -> dict:
    return {"id": pid, "question": f"Question {pid}?", "answer": pid[1:], "correct": correct,
            "completion": f"{stage} completion of {pid}" + ("\n```python\nprint(1)\n```" if pid == "p1" else "")}


@pytest.fixture
def workspace(tmp_path) -> tuple[Path, list[dict]]:
    root = tmp_path / "ws"
    metrics = root / "metrics"
    plots = metrics / "train" / "plots" / "metrics"
    plots.mkdir(parents=True)
    for name, body in (("baseline", BASELINE), ("final", FINAL), ("train", TRAIN), ("sent", SENT)):
        (metrics / f"{name}.json").write_text(json.dumps(body))
    steps = make_steps(same=False)
    for i, r in enumerate(steps):
        r.update(entropy_mean=1.5 - 0.05 * i, kl=0.001 * i, kept_frac=0.2 + 0.01 * i, completion_len=40.0 + i)
    for key in ("accuracy", "reward_mean", "stage", *SIGNALS):
        write_tsv(plots / f"{key}.tsv", key, [float(r[key]) for r in steps], timestamp=key == "reward_mean")
    cache = root / "data" / "cache"
    cache.mkdir(parents=True)
    (cache / "train_sorted.jsonl").write_text("".join(json.dumps({"id": i, "semantic_entropy": e}) + "\n"
                                                      for i, e in enumerate(ENTROPIES)))
    ev = root / "outputs" / "eval"
    ev.mkdir(parents=True)
    (ev / "baseline.jsonl").write_text("".join(json.dumps(eval_record(p, b, "baseline")) + "\n" for p, b, _ in EVAL))
    finals = [eval_record(p, f, "final") for p, _, f in EVAL] + [eval_record("p6", True, "final")]
    (ev / "final.jsonl").write_text("".join(json.dumps(r) + "\n" for r in finals))
    (root / "params.yaml").write_text("train:\n  lr: 0.000123\n  loss_type: dapo\n")
    return root, steps


def test_read_step_metrics_merges_the_tsv_files_by_step(workspace):
    root, steps = workspace
    rows = read_step_metrics(root / "metrics" / "train" / "plots" / "metrics")
    assert [r["step"] for r in rows] == list(range(1, 13))  # numeric order: 10 after 9
    for got, want in zip(rows, steps):
        assert got == pytest.approx(want)


def table_row(md: str, first_cell: str) -> list[str]:
    (line,) = [ln for ln in md.splitlines() if ln.startswith(f"| {first_cell} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_build_report_from_a_workspace(workspace, tmp_path, figures):
    root, steps = workspace
    out = tmp_path / "reports"
    md_path = build_report(root, out)
    md = md_path.read_text()
    assert md_path == out / "report.md"

    # result table, delta and n
    for name, m in (("baseline", BASELINE), ("final", FINAL)):
        cells = table_row(md, name)
        assert float(cells[1]) == pytest.approx(m["accuracy"], abs=5e-4)
        assert [float(v) for v in re.findall(r"\d\.\d+", cells[2])] == pytest.approx(
            [m["accuracy_ci95_low"], m["accuracy_ci95_high"]], abs=5e-4)
        assert float(cells[3]) == pytest.approx(m["format_rate"], abs=5e-4)
        assert int(cells[4]) == m["n"]
        assert m["weights"] in cells and m["backend"] in cells
    delta = re.search(r"change\W*([+-]\d+\.\d+)", md)
    assert float(delta.group(1)) == pytest.approx(FINAL["accuracy"] - BASELINE["accuracy"], abs=5e-4)

    # train summary, SENT summary, params
    assert int(table_row(md, "steps")[1]) == 12
    assert float(table_row(md, "final_accuracy")[1]) == pytest.approx(0.4375, rel=1e-3)
    assert float(table_row(md, "total_time_s")[1]) == pytest.approx(123.456, rel=1e-3)
    assert "M=4" in md and "0.693" in md and "25%" in md
    assert "loss_type: dapo" in md and "lr: 0.000123" in md

    # every linked image exists and is a PNG; the HTML links the same ones
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert set(links) == {"accuracy.png", "curves.png", "signals.png", "sent_entropy.png"}
    for name in links:
        assert Image.open(out / name).format == "PNG"
    html = (out / "report.html").read_text()
    assert set(re.findall(r'<img[^>]*src="([^"]+)"', html)) == set(links)
    assert html.count("<table>") >= 3

    # examples: pairs by id, the fixed problems first, labels match each side's correctness
    shown = re.findall(r"\*\*Question (p\d)\?\*\*", md)
    assert "p6" not in shown and set(shown) <= {p for p, _, _ in EVAL}
    assert set(shown[:2]) == {"p1", "p5"}  # the two fixed ones lead
    for pid in shown:
        b, f = next((b, f) for p, b, f in EVAL if p == pid)
        block = md.split(f"**Question {pid}?**", 1)[1].split("**Question", 1)[0]
        assert re.search(rf"Baseline \({'correct' if b else 'wrong'}\):\n```\nbaseline completion of {pid}", block)
        assert re.search(rf"Final \({'correct' if f else 'wrong'}\):\n```\nfinal completion of {pid}", block)
    assert "'''python" in md and "```python" not in md  # a fence inside a completion cannot end the block
    assert md.count("```") % 2 == 0

    # what the figures draw
    (ax,) = figures["accuracy.png"].axes
    bars = next(c for c in ax.containers if hasattr(c, "patches"))
    assert [p.get_height() for p in bars.patches] == pytest.approx([BASELINE["accuracy"], FINAL["accuracy"]])
    (segs,) = [lc.get_segments() for lc in bars.errorbar.lines[2]]
    assert [y for s in segs for y in (s[0][1], s[1][1])] == pytest.approx(
        [y for m in (BASELINE, FINAL) for y in (m["accuracy_ci95_low"], m["accuracy_ci95_high"])])
    assert "60" in ax.get_ylabel()

    raw, smoothed, vlines = curve_lines(figures["curves.png"], steps)
    assert sorted(list(ln.get_ydata()) for ln in raw) == sorted(
        [[r["reward_mean"] for r in steps], [r["accuracy"] for r in steps]])
    assert vlines == BOUNDARIES

    signal_axes = figures["signals.png"].axes
    assert len(signal_axes) == len(SIGNALS)
    for ax, (key, title) in zip(signal_axes, SIGNALS.items()):
        assert title.lower() in ax.get_title().lower()
        (line,) = ax.get_lines()
        assert list(line.get_ydata()) == pytest.approx([r[key] for r in steps])

    (ax,) = figures["sent_entropy.png"].axes
    assert sum(p.get_height() for p in ax.patches) == len(ENTROPIES)


def test_build_report_of_an_empty_workspace_says_what_is_missing(tmp_path, figures):
    out = tmp_path / "reports"
    md = build_report(tmp_path / "empty", out).read_text()
    assert "missing" in md.lower()
    assert re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md) == []
    assert figures == {} and list(out.glob("*.png")) == []
    assert (out / "report.html").exists()


def test_report_plots_validation_and_marks_the_evaluated_adapter(workspace, tmp_path, figures):
    root, steps = workspace
    plots = root / "metrics" / "train" / "plots" / "metrics"
    val = {4: 0.41, 8: 0.55, 12: 0.48}  # dvclive writes val_accuracy only at the validated steps
    (plots / "val_accuracy.tsv").write_text("step\tval_accuracy\n" + "".join(f"{s}\t{v}\n" for s, v in val.items()))
    final = dict(FINAL, adapter={"adapter": "best validation accuracy", "step": 8, "val_accuracy": 0.55})
    (root / "metrics" / "final.json").write_text(json.dumps(final))

    md = build_report(root, tmp_path / "reports").read_text()
    assert "validation.png" in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert [float(table_row(md, str(s))[1]) for s in (4, 12)] == pytest.approx([0.41, 0.48], abs=5e-4)
    assert float(table_row(md, "8 (evaluated)")[1]) == pytest.approx(0.55, abs=5e-4)

    (ax,) = figures["validation.png"].axes
    curve = next(ln for ln in ax.get_lines() if ln.get_label() == "validation accuracy")
    assert list(curve.get_xdata()) == list(val) and list(curve.get_ydata()) == pytest.approx(list(val.values()))
    (star,) = [ln for ln in ax.get_lines() if ln.get_marker() == "*"]
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([8], pytest.approx([0.55]))
    vertical = sorted(float(ln.get_xdata()[0]) for ln in ax.get_lines() if ln not in (curve, star))
    assert vertical == BOUNDARIES


def test_report_without_validation_draws_no_validation_plot(workspace, tmp_path, figures):
    root, _ = workspace
    md = build_report(root, tmp_path / "reports").read_text()
    assert "validation" not in md.lower() and "validation.png" not in figures
