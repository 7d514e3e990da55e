"""Collect what ``bench/gpu_check.sh`` measured into one JSON and a printed table.

    python bench/gpu_report.py OUT_DIR

Reads, from OUT_DIR, whichever of these the phases wrote: ``env.json`` (versions, device),
``phases.txt`` (``name exit_code`` per phase run), ``pytest.xml`` (the CUDA-marked tests, JUnit),
``entropy_kernel.json`` (``bench/entropy_kernel.py --json``), ``grpo_step_engine.json`` (the step
with engine rollouts) and ``grpo_step.json`` (the decode-loop step, ``bench/grpo_step.py --json``),
and ``not_checked.txt`` (``phase reason`` per phase that could not run here, e.g. no vLLM); writes
``gpu_check.json`` and prints the table. Exit code 0 when every phase that ran passed its check
(tests green, kernel within bf16 tolerance of PyTorch, the engine step ran, the seed-003 decode-loop
step's peak allocated memory at most ``TARGET_GB``), else 1; a phase not checked is named in the
last line but fails nothing.
"""

from __future__ import annotations

import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TARGET_GB = 5.0  # peak allocated memory of seed 003's step, all savings on (1 GB = 1e9 bytes)
KERNEL_TOLERANCE = 2e-2  # bf16 logits, fp32 math in both paths (bench/entropy_kernel.py's own bound)
MB = 2**20  # the benches report MB as MiB (bytes / 2**20)


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def pytest_counts(path: Path) -> dict | None:
    """passed / failed / errors / skipped of a JUnit XML file."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    cases = [
        {"name": f"{c.get('classname')}::{c.get('name')}",
         "outcome": next((child.tag for child in c if child.tag in ("failure", "error", "skipped")), "passed")}
        for s in suites for c in s.iter("testcase")
    ]
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"], "cases": cases}


def step_figures(result: dict) -> dict:
    """The seed-003 step with every saving on, and each saving's effect (switched off minus on)."""
    table = result.get("ablation") or []
    on = table[0] if table else None
    if on is None:  # --ablate not given: the plain run
        runs = [r for r in result.get("ours", {}).get("steps", [])]
        if not runs:
            return {}
        peak = max(r.get("peak_allocated_mb", r.get("peak_rss_mb", math.nan)) for r in runs)
        reserved = [r["peak_reserved_mb"] for r in runs if "peak_reserved_mb" in r]
        on = {"configuration": "all savings on", "peak_mb": peak, "peak_reserved_mb": max(reserved, default=None),
              "step_s": sorted(r["step_s"] for r in runs)[len(runs) // 2],
              **{k: sorted(r[k] for r in runs)[len(runs) // 2] for k in ("generate", "logprob", "fwd_bwd", "optimizer")}}
    peak_gb = on["peak_mb"] * MB / 1e9
    cuda = result.get("ours", {}).get("device") == "cuda"  # on the CPU the peak is the process's RSS
    config = result.get("config", {})
    out = {
        "device": result.get("ours", {}).get("device"),
        "shape": f"{config.get('arch') or config.get('model')}: {config.get('prompts')} prompt x G={config.get('group')}, "
                 f"{config.get('prompt_tokens')} prompt + {config.get('new_tokens')} new tokens",
        "all_savings_on": {k: on.get(k) for k in ("peak_mb", "peak_reserved_mb", "step_s", "generate", "logprob",
                                                   "fwd_bwd", "optimizer", "step_times")},
        "peak_gb": peak_gb,  # allocated on CUDA, RSS on the CPU
        "target_gb": TARGET_GB,
        "target_met": peak_gb <= TARGET_GB if cuda else None,
        "savings": [],
    }
    for row in table[1:]:
        out["savings"].append({
            "configuration": row["configuration"],
            "peak_mb": row["peak_mb"],
            "peak_reserved_mb": row.get("peak_reserved_mb"),
            "step_s": row["step_s"],
            "peak_mb_saved": row["peak_mb"] - on["peak_mb"],
            "step_s_saved": row["step_s"] - on["step_s"],
        })
    if "trl" in result and "steps" in result["trl"]:
        trl_steps = sorted(s["step_s"] for s in result["trl"]["steps"])
        out["trl_step_s"] = trl_steps[len(trl_steps) // 2]
        out["ours_over_trl"] = on["step_s"] / out["trl_step_s"]
    return out


def kernel_figures(k: dict) -> dict:
    err = max(k["max_entropy_diff"], k["max_logp_diff"])
    return {**k, "speedup": k["torch_s"] / k["triton_s"] if k["triton_s"] else math.nan,
            "memory_ratio": (k["triton_peak_extra_mb"] / k["torch_peak_extra_mb"]
                             if k["torch_peak_extra_mb"] else math.nan),
            "within_tolerance": err <= KERNEL_TOLERANCE}


def build(out: Path) -> tuple[dict, list[str]]:
    """The report dict and the list of failed checks."""
    phases = {}
    if (out / "phases.txt").exists():
        for line in (out / "phases.txt").read_text().split("\n"):
            if line.strip():
                name, code = line.split()
                phases[name] = int(code)
    not_checked = {}
    if (out / "not_checked.txt").exists():
        for line in (out / "not_checked.txt").read_text().split("\n"):
            if line.strip():
                name, _, reason = line.partition(" ")
                not_checked[name] = reason.strip()
    report: dict = {"env": _load(out / "env.json"), "phases": phases, "not_checked": not_checked}
    failed = [f"phase {name} exited {code}" for name, code in phases.items() if code]
    if "tests" in phases:
        tests = pytest_counts(out / "pytest.xml")
        report["tests"] = tests
        if tests is None:
            failed.append("tests: no pytest.xml")
        elif tests["failed"] or tests["errors"] or not tests["passed"]:
            failed.append(f"tests: {tests['failed']} failed, {tests['errors']} errors, {tests['passed']} passed")
    if "kernel" in phases:
        k = _load(out / "entropy_kernel.json")
        report["kernel"] = kernel_figures(k) if k else None
        if not k:
            failed.append("kernel: no entropy_kernel.json")
        elif not report["kernel"]["within_tolerance"]:
            failed.append("kernel: Triton and PyTorch disagree beyond bf16 tolerance")
    if "engine" in phases:
        e = _load(out / "grpo_step_engine.json")
        report["engine"] = step_figures(e) if e else None
        if not report["engine"]:
            failed.append("engine: no grpo_step_engine.json")
        else:
            report["engine"]["target_met"] = None  # TARGET_GB is the decode-loop step's; the engine adds its own
    if "step" in phases:
        s = _load(out / "grpo_step.json")
        report["step"] = step_figures(s) if s else None
        if not report["step"]:
            failed.append("step: no grpo_step.json")
        elif report["step"]["target_met"] is False:
            failed.append(f"step: peak allocated {report['step']['peak_gb']:.2f} GB > {TARGET_GB} GB")
    report["failed_checks"] = failed
    report["ok"] = not failed
    return report, failed


def table(report: dict) -> str:
    lines = []
    env = report.get("env") or {}
    if env:
        lines.append(f"device: {env.get('device')} | python {env.get('python')} | torch {env.get('torch')} "
                     f"(CUDA {env.get('cuda')}) | transformers {env.get('transformers')} | triton {env.get('triton')} | "
                     f"peft {env.get('peft')} | accelerate {env.get('accelerate')} | bitsandbytes {env.get('bitsandbytes')}")
    t = report.get("tests")
    if t:
        lines.append(f"{'CUDA tests (pytest -m cuda)':<44} {t['passed']} passed, {t['failed']} failed, "
                     f"{t['errors']} errors, {t['skipped']} skipped")
    k = report.get("kernel")
    if k:
        lines.append(f"{'entropy kernel':<44} {k['rows']} x {k['vocab']} bf16 logits ({k.get('logits_mb', 0):.0f} MB)")
        lines.append(f"{'  time (median)':<44} triton {k['triton_s'] * 1e3:.3f} ms, torch {k['torch_s'] * 1e3:.3f} ms "
                     f"({k['speedup']:.2f}x)")
        lines.append(f"{'  peak extra memory':<44} triton {k['triton_peak_extra_mb']:.1f} MB, "
                     f"torch {k['torch_peak_extra_mb']:.1f} MB")
        lines.append(f"{'  max |diff| entropy / logp':<44} {k['max_entropy_diff']:.2e} / {k['max_logp_diff']:.2e}")
    e = report.get("engine")
    if e:
        on = e["all_savings_on"]
        lines.append(f"engine step ({e['shape']}; rollouts from vLLM holding the policy)")
        lines.append(f"{'  peak':<44} {'allocated' if e['device'] == 'cuda' else 'RSS'} {e['peak_gb']:.2f} GB, "
                     + (f"reserved {on['peak_reserved_mb'] * MB / 1e9:.2f} GB, " if on.get("peak_reserved_mb") else "")
                     + f"step {on['step_s']:.2f} s")
        phases = " ".join(f"{p} {on[p]:.2f}" for p in ("generate", "logprob", "fwd_bwd", "optimizer") if on.get(p) is not None)
        if phases:
            lines.append(f"{'  phases (s)':<44} {phases}")
    s = report.get("step")
    if s:
        on = s["all_savings_on"]
        mark = {True: "met", False: "MISSED", None: "n/a: CPU RSS, not CUDA memory"}[s["target_met"]]
        lines.append(f"step ({s['shape']})")
        lines.append(f"{'  all savings on':<44} peak {'allocated' if s['device'] == 'cuda' else 'RSS'} "
                     f"{s['peak_gb']:.2f} GB (target <= {s['target_gb']} GB: {mark}), "
                     + (f"reserved {on['peak_reserved_mb'] * MB / 1e9:.2f} GB, " if on.get("peak_reserved_mb") else "")
                     + f"step {on['step_s']:.2f} s")
        phases = " ".join(f"{p} {on[p]:.2f}" for p in ("generate", "logprob", "fwd_bwd", "optimizer") if on.get(p) is not None)
        if phases:
            lines.append(f"{'  phases (s)':<44} {phases}")
        if "trl_step_s" in s:
            lines.append(f"{'  TRL step (s)':<44} {s['trl_step_s']:.2f} (ours / TRL {s['ours_over_trl']:.2f})")
        if s["savings"]:
            lines.append(f"  {'switched off':<64} {'peak MB':>9} {'+MB':>8} {'step s':>8} {'+s':>7}")
            for row in s["savings"]:
                lines.append(f"  {row['configuration']:<64} {row['peak_mb']:9.0f} {row['peak_mb_saved']:+8.0f} "
                             f"{row['step_s']:8.2f} {row['step_s_saved']:+7.2f}")
    skipped = "; ".join(f"{name} ({why})" for name, why in (report.get("not_checked") or {}).items())
    verdict = "all checks passed" if report["ok"] else "FAILED: " + "; ".join(report["failed_checks"])
    lines.append("gpu_check: " + verdict + (f"; NOT CHECKED: {skipped}" if skipped else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    report, failed = build(out)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
