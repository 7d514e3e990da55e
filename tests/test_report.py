"""The run report: smoothing, what the plots draw, and what ``build_report`` writes from a
fabricated workspace (metrics, the dvclive per-step tables, evaluation records, the SENT cache).

Figures are captured when they are saved (``Figure.savefig`` is wrapped), so the tests read the
plotted data back from the matplotlib artists instead of looking at pixels.
"""

from __future__ import annotations

import base64
import json
import math
import re
import subprocess
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from PIL import Image

from grpo.algorithm.rewards import extract_answer
from grpo.data.answers import CLASS_WORDS
from grpo.evaluation.report import (
    TRAIN_ROWS,
    adapter_in_words,
    build_report,
    headline,
    moving_average,
    plot_curves,
    read_step_metrics,
)


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
        steps.append({"step": i + 1, "stage": stage, "rollout_accuracy": acc,
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

    series = {"reward": [r["reward_mean"] for r in steps], "accuracy": [r["rollout_accuracy"] for r in steps]}
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
    accuracy = [r["rollout_accuracy"] for r in steps]
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
    for key in ("rollout_accuracy", "reward_mean", "stage", *SIGNALS):
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
    (root / "params.yaml").write_text("train:\n  optimizer:\n    lr: 0.000123\n  loss:\n    loss_type: dapo\n")
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

    # result table, delta and n; the weights, the engine and the format rate in words
    for name, m in (("before training", BASELINE), ("after training", FINAL)):
        cells = table_row(md, name)
        assert float(cells[1]) == pytest.approx(m["accuracy"], abs=5e-4)
        assert [float(v) for v in re.findall(r"\d\.\d+", cells[2])] == pytest.approx(
            [m["accuracy_ci95_low"], m["accuracy_ci95_high"]], abs=5e-4)
        assert int(cells[3]) == m["n"]
        assert m["weights"] in md
    assert "by vllm" in md
    assert "`#### N`" in md and "10% before training, 80% after" in md
    delta = re.search(r"change of \*\*([+-]\d+\.\d+)", md)
    assert float(delta.group(1)) == pytest.approx(FINAL["accuracy"] - BASELINE["accuracy"], abs=5e-4)
    assert "| 0.000 |" not in md

    # train summary in words (the last step's rollout accuracy left out), SENT summary, params
    assert int(table_row(md, "training steps")[1]) == 12
    assert "final_accuracy" not in md and "0.4375" not in md and "0.438" not in md
    assert table_row(md, "training time (all steps)")[1] == "123 s"
    assert "4 answers to each of the 8 training prompts" in md and "0.693" in md and "25%" in md
    assert "loss_type: dapo" in md and "lr: 0.000123" in md

    # every linked image exists and is a PNG; the HTML links the same ones
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert set(links) == {"accuracy.png", "curves.png", "signals.png", "sent_entropy.png"}
    for name in links:
        assert Image.open(out / name).format == "PNG"
    html = (out / "report.html").read_text()  # one file: the same PNGs inlined
    inlined = re.findall(r'<img[^>]*src="data:image/png;base64,([^"]+)"', html)
    assert sorted(base64.b64decode(d) for d in inlined) == sorted((out / n).read_bytes() for n in links)
    assert len(re.findall(r"<img", html)) == len(links)
    assert html.count("<table>") >= 3

    # examples: pairs by id, the fixed problems first, labels match each side's correctness
    shown = re.findall(r"\*\*Question (p\d)\?\*\*", md)
    assert "p6" not in shown and set(shown) <= {p for p, _, _ in EVAL}
    assert set(shown[:2]) == {"p1", "p5"}  # the two fixed ones lead
    for pid in shown:
        b, f = next((b, f) for p, b, f in EVAL if p == pid)
        block = md.split(f"**Question {pid}?**", 1)[1].split("**Question", 1)[0]
        assert re.search(rf"Before training \({'correct' if b else 'wrong'}\):\n```\nbaseline completion of {pid}", block)
        assert re.search(rf"After training \({'correct' if f else 'wrong'}\):\n```\nfinal completion of {pid}", block)
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
        [[r["reward_mean"] for r in steps], [r["rollout_accuracy"] for r in steps]])
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
    assert float(table_row(md, "8 (the adapter evaluated on test)")[1]) == pytest.approx(0.55, abs=5e-4)
    assert "best validation accuracy, step 8 (validation 0.550)" in md and "{" not in md.split("## SENT")[0]

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


# ---------------------------------------------------------------- header, words, headline -------

def test_header_names_the_date_commit_seeds_and_the_changed_params(workspace, tmp_path):
    root, _ = workspace
    md = build_report(root, tmp_path / "r1").read_text()
    head = md.split("## Result")[0]
    assert re.search(r"Made \d{4}-\d\d-\d\d \d\d:\d\d UTC \(not in a git repository\)", head)
    assert "Seeds: data 0, SENT 0, training 0." in head
    assert table_row(head, "`train.optimizer.lr`") == ["`train.optimizer.lr`", "0.000123", "0.0003"]  # loss_type: dapo is the default
    assert "loss_type" not in head

    for cmd in (["init", "-q"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", *cmd], cwd=root, check=True, capture_output=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    (root / "params.yaml").write_text("train:\n  seed: 3\n")
    head = build_report(root, tmp_path / "r2").read_text().split("## Result")[0]
    assert f"from commit `{sha}` of 20" in head and "uncommitted" not in head
    assert "training 3." in head and table_row(head, "`train.seed`")[1:] == ["3", "0"]
    (root / "src").mkdir()
    (root / "src" / "x.py").write_text("")
    assert "with uncommitted changes to the code" in build_report(root, tmp_path / "r3").read_text()
    (root / "params.yaml").write_text("train: {}\n")
    assert "none changed" in build_report(root, tmp_path / "r4").read_text()


def test_the_kl_panel_is_left_out_when_it_is_zero_at_every_step(workspace, tmp_path, figures):
    root, steps = workspace
    write_tsv(root / "metrics" / "train" / "plots" / "metrics" / "kl.tsv", "kl", [0.0] * len(steps))
    md = build_report(root, tmp_path / "reports").read_text()
    titles = [ax.get_title() for ax in figures["signals.png"].axes]
    assert len(titles) == 3 and not any("KL" in t for t in titles)
    assert "Not drawn: KL to the reference policy: 0 at every step (train.loss.beta is 0" in md


def test_a_format_rate_of_zero_is_said_in_words(workspace, tmp_path):
    root, _ = workspace
    for name, m in (("baseline", BASELINE), ("final", FINAL)):
        (root / "metrics" / f"{name}.json").write_text(json.dumps(dict(m, format_rate=0.0)))
    md = build_report(root, tmp_path / "reports").read_text()
    assert "Neither model ends its answers with the `#### N` line" in md and "0%" in md
    assert "0.000" not in md.split("## Result")[1].split("## Training")[0]


def test_adapter_in_words():
    assert adapter_in_words({"adapter": "best validation accuracy", "step": 20, "val_accuracy": 0.835820895522388}) \
        == "best validation accuracy, step 20 (validation 0.836)"
    assert adapter_in_words({"adapter": "last step", "step": 40, "val_accuracy": None}) == "last step, step 40 (no validation)"
    assert adapter_in_words(None) == "not recorded"


def test_headline_has_the_test_accuracies_and_the_shipped_adapters_validation_accuracy():
    final = dict(FINAL, adapter={"adapter": "best validation accuracy", "step": 8, "val_accuracy": 0.55556})
    assert headline(BASELINE, final, TRAIN) == {"test_accuracy_before": 0.3, "test_accuracy_after": 0.45,
                                                "val_accuracy": 0.5556}
    assert headline(None, FINAL, {"adapter": {"val_accuracy": 0.5}}) == {"test_accuracy_after": 0.45, "val_accuracy": 0.5}
    assert headline(None, None, None) == {}


def test_the_report_stage_writes_the_headline_metric(workspace, monkeypatch):
    from tasks.report import main

    root, _ = workspace
    monkeypatch.chdir(root)
    assert main([]) == 0
    assert json.loads((root / "metrics" / "headline.json").read_text()) == {"test_accuracy_before": 0.3,
                                                                             "test_accuracy_after": 0.45}
    assert (root / "reports" / "report.html").exists() and (root / "metrics" / "time" / "report.json").exists()


def test_the_html_fits_a_phone_and_every_figure_fits_1000_px(workspace, tmp_path):
    root, _ = workspace
    out = tmp_path / "reports"
    build_report(root, out)
    html = (out / "report.html").read_text()
    assert "width=device-width" in html and "img{max-width:100%;height:auto}" in html
    assert "overflow-x:auto" in html  # a wide table scrolls instead of widening the page
    for png in out.glob("*.png"):
        assert Image.open(png).width <= 1000, png.name


def test_missing_dvc_outputs_are_named_and_the_rest_is_reported(workspace, tmp_path, figures):
    root, _ = workspace
    (root / "data" / "cache" / "train_sorted.jsonl").unlink()
    (root / "outputs" / "eval" / "final.jsonl").unlink()
    md = build_report(root, tmp_path / "reports").read_text()
    assert "4 answers to each of the 8 training prompts" in md  # metrics/sent.json is still there
    assert "`data/cache/train_sorted.jsonl` is not in this workspace" in md and "sent_entropy.png" not in figures
    assert "`outputs/eval/final.jsonl` is not in this workspace" in md and "Before training (" not in md


def test_the_params_file_is_folded_away_in_the_html(workspace, tmp_path):
    root, _ = workspace
    out = tmp_path / "reports"
    build_report(root, out)
    html = (out / "report.html").read_text()
    folded = html.split("<details>", 1)[1].split("</details>", 1)[0]
    assert "<summary>The params file</summary>" in folded and "lr: 0.000123" in folded and "<pre><code" in folded


def test_inline_images_inlines_existing_pngs_and_keeps_other_links(tmp_path):
    from grpo.evaluation.report import inline_images

    png = b"\x89PNG fake"
    (tmp_path / "a.png").write_bytes(png)
    text = "x ![one](a.png) y ![two](missing.png) [a link](a.png)\n"
    encoded = base64.b64encode(png).decode()
    assert inline_images(text, tmp_path) == (f"x ![one](data:image/png;base64,{encoded}) y "
                                             "![two](missing.png) [a link](a.png)\n")


def test_the_report_says_what_was_learned_with_intervals_that_count_a_problem_once(workspace, tmp_path):
    """Metrics with the clustered interval and the answers' classes: the result table shows the
    clustered bounds, distinct problems and effective n and names the method; the classes and the
    digit groups come out as tables with a few answers of each class; the train summary states
    where archer's band acted."""
    from grpo.evaluation.evaluate import what_was_learned

    root, _ = workspace
    records = {"baseline": [("Compute 5 + 1.", "6", "To solve 5 + 1, we add 5 and 1."),
                            ("Compute 1 + 5.", "6", "It is 7."), ("What is 25 + 8?", "33", "no idea")],
               "final": [("Compute 5 + 1.", "6", "5 + 1 = 6"), ("Compute 1 + 5.", "6", "1 + 5 = 6"),
                         ("What is 25 + 8?", "33", "25 + 8 = 33, plus 1 is 34")]}
    metrics = {}
    for name, rows in records.items():
        recs = [{"id": f"p{i}", "question": q, "answer": a, "completion": c,
                 "correct": extract_answer(c) == a} for i, (q, a, c) in enumerate(rows)]
        (root / "outputs" / "eval" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        base = BASELINE if name == "baseline" else FINAL
        metrics[name] = {**base, **what_was_learned(recs, [float(r["correct"]) for r in recs])}
        (root / "metrics" / f"{name}.json").write_text(json.dumps(metrics[name]))
    (root / "metrics" / "train.json").write_text(json.dumps({**TRAIN, "mean_wide_band_frac": 0.0123,
                                                             "mean_wide_band_grad_share": 0.0456}))
    md = build_report(root, tmp_path / "reports").read_text()
    for name, m in (("before training", metrics["baseline"]), ("after training", metrics["final"])):
        cells = table_row(md, name)
        assert [float(v) for v in re.findall(r"\d\.\d+", cells[2])] == pytest.approx([m["ci_low"], m["ci_high"]],
                                                                                    abs=5e-4)
        assert cells[4] == f"{m['clusters']}; {m['effective_n']:.0f}" and m["clusters"] == 2
    assert metrics["final"]["ci_method"] in md
    learned = md.split("## What was learned", 1)[1].split("\n## ", 1)[0]
    for cls, words in CLASS_WORDS.items():
        b, f = metrics["baseline"]["failure_classes"][cls], metrics["final"]["failure_classes"][cls]
        assert table_row(learned, words)[1].startswith(f"{b} (") and table_row(learned, words)[2].startswith(f"{f} (")
    assert table_row(learned, "1 & 1")[1:] == ["2", "0.00 (0/2)", "1.00 (2/2)"]
    assert f"*{CLASS_WORDS['sum_not_last']}, after training*" in learned and "plus 1 is 34" in learned
    assert "1.23%" in table_row(md, next(w for k, w in TRAIN_ROWS if k == "mean_wide_band_frac"))[1]


def test_a_cell_with_pipes_stays_one_cell_in_the_html():
    from grpo.evaluation.report import _cell, to_html

    words = "their share of the policy gradient (|dL/dlogp|), mean per step"
    html = to_html("\n".join(["| quantity | value |", "|---|---|", f"| {_cell(words)} | {_cell('0.55%')} |", ""]))
    row = html.split("<tbody>")[1].split("</tr>")[0]
    assert row.count("<td>") == 2 and "(|dL/dlogp|)" in row and "0.55%" in row


def test_a_signal_flat_at_every_step_is_left_out_with_its_value():
    from grpo.evaluation.report import signal_panels

    steps = [{"step": i, "entropy_mean": 0.5 + i, "kept_frac": 1.0, "wide_band_frac": 0.01 * i} for i in range(3)]
    shown, left_out = signal_panels(steps)
    assert [k for k, _ in shown] == ["entropy_mean", "wide_band_frac"]
    assert any(line.startswith("kept-token fraction (entropy mask): 1 at every step") for line in left_out)
