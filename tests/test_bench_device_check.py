"""bench/device_check.py on the CPU: the dry run of every phase, the time limits and budgets, an
out-of-memory error failing its phase, the cut wheel.

The GPU machine is lent now and then, for minutes: the check must work the first time there.
Here it runs as it runs there (the same children, limits and JSON), at toy sizes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import device_budgets  # noqa: E402
import device_check  # noqa: E402
import device_train  # noqa: E402
import report_schema  # noqa: E402


def run_check(out: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/device_check.py", "run", str(out), "--dry-run", *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_dry_run_passes_every_phase_without_dvclive_and_writes_three_files_that_conform(tmp_path):
    """Every phase passes on the CPU with dvclive unimportable, as on the GPU machine (the context
    phase, a CUDA figure, is skipped saying why), the JSON conforms to SCHEMA (each phase's part
    filled in by its own script) and names the commit passed, and OUT holds at most the 8 files a
    device call brings back."""
    done = run_check(tmp_path / "out", "--commit", "0123abc+dirty", "--phases", "all", "--without", "dvclive",
                     timeout=device_check.DEFAULT_BUDGET_S * device_check.DRY_SCALE + 60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert device_check.schema_errors(report, device_check.SCHEMA) == []
    assert report["finished"] and report["ok"] and report["dry_run"] and report["without"] == ["dvclive"]
    assert (report["commit"], report["commit_source"]) == ("0123abc+dirty", "passed")
    assert {name: row["status"] for name, row in report["phases"].items()} == {
        **dict.fromkeys(device_check.PHASES, "passed"), "context": "skipped"}
    assert report["phases"]["context"]["why"].startswith("no CUDA device") and report["phases"]["context"]["rc"] == 0
    assert report["tests"]["passed"] > 0 and report["tests"]["failed"] == 0
    assert report["nan_guard"]["ok"] and report["nan_guard"]["lr_advanced_on_skip"] is False
    assert report["update"]["estimate_gib"] > 0 and report["nf4_rows"]["rows"]
    generation = report["generation"]["variants"]
    assert generation["dense-static"]["ms_per_token"] > 0 and generation["nf4-dynamic"]["ms_per_token"] is None
    assert generation["dense-static-graph"]["error"] == "a CUDA graph needs CUDA"
    train = report["train_stage"]
    assert train["ok"] and train["resumed_from"] == 1 and train["skipped"] == [] and train["lanes"] == 2
    assert train["unbroken_pair"] == {"same_bytes": True, "max_abs_diff": 0.0}  # the CPU: equal bytes
    assert train["deterministic_why"] == "--deterministic never" and train["deterministic"]["rc"] is None
    det = report["deterministic"]
    assert det["ok"] and det["deterministic_why"].startswith("--deterministic only; ran 2 of 2")
    assert det["deterministic_pair"]["same_bytes"] and det["deterministic_step_ratio"] > 0
    assert set(det["skipped"]) == {"unbroken_again", "killed", "resumed"}
    rules = report["rules"]  # the update phase's default is profiled: rules measures its own
    assert rules["default_from"] == "rules" and rules["default"]["profile"]["step_s"] is None
    assert rules["high"]["entropy_rule"] == "high" and rules["default_rule"] == report["update"]["entropy_rule"]
    assert report["context"]["memory_cap_gib"] is None  # a CUDA figure: null on the CPU
    assert report["step"]["ours"]["steps"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device_check.json", "device_check.log", "pytest.xml"]
    log = (tmp_path / "out" / "device_check.log").read_text()
    assert all(f"===== {name}: " in log for name in device_check.PHASES)
    assert "dvclive is not importable (No module named 'dvclive'" in log  # the stage's one line, and on it went


@pytest.mark.slow
def test_a_phase_past_its_limit_is_killed_and_the_run_goes_on_within_its_budget(tmp_path):
    """The step phase limited to 2 s (it builds a model and trains a step: longer on any
    machine): its child (and the child's own workers) is killed at the limit, the phase is
    recorded as timed out, and the run ends, exit 1, the JSON complete."""
    done = run_check(tmp_path / "out", "--phases", "step", "--limit", "step=2", timeout=120)
    assert done.returncode == 1, done.stdout[-3000:]
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert device_check.schema_errors(report, device_check.SCHEMA) == []
    assert report["phases"]["probe"]["status"] == "passed"
    assert report["phases"]["step"]["status"] == "timed out" and report["phases"]["step"]["rc"] is None
    assert report["phases"]["tests"]["status"] == "skipped" and report["finished"] and not report["ok"]
    assert report["phases"]["step"]["seconds"] < 10


@pytest.mark.slow
def test_the_default_dry_run_passes_every_default_phase_prints_the_budgets_and_profiles_the_update(tmp_path):
    """The default call on the CPU (``--without dvclive``, as on the GPU machine): every default
    phase passes, the others are not run; the budget table is printed and in the JSON, its default
    limits adding up to at most the budget; the update's profile has its fields (CPU figures on a
    CPU, its CUDA ones null); the peaks are named as bench/cuda_memory.py names its calls."""
    done = run_check(tmp_path / "out", "--without", "dvclive",
                     timeout=device_check.DEFAULT_BUDGET_S * device_check.DRY_SCALE + 60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert device_check.schema_errors(report, device_check.SCHEMA) == []
    status = {name: row["status"] for name, row in report["phases"].items()}
    assert status == {name: "passed" if name in device_check.DEFAULT_PHASES else "skipped" for name in device_check.PHASES}
    assert report["default_sum_s"] <= device_check.DEFAULT_BUDGET_S
    assert {n: b["limit_s"] for n, b in report["budgets"].items()} == {n: p.limit_s for n, p in device_check.PHASES.items()}
    table = device_budgets.table(device_check.BUDGETS, device_check.DEFAULT_PHASES, device_check.RUN_MARGIN_S)
    assert all(line in done.stdout for line in table)
    profile = report["update"]["profile"]
    assert profile["device"] == "cpu" and profile["step_s"] > 0 and profile["cpu_ms"] > 0 and profile["operators"] > 0
    assert profile["top_cpu"] and all(row["calls"] > 0 and row["cpu_ms"] >= 0 for row in profile["top_cpu"])
    assert profile["cuda_ms"] is None and profile["launches"] is None and profile["top_cuda"] == []
    assert report["update"]["step_s"] == profile["step_s"]  # the second step, profiled
    generation = report["generation"]["variants"]
    assert generation["dense-static"]["tokens"] == 8 and generation["dense-static"]["persistent"] is False
    assert generation["dense-static-graph"]["error"] == "a CUDA graph needs CUDA"
    assert report["samplers"]["sent"]["loop"].startswith("dynamic") and report["samplers"]["evaluate"]["seconds"] > 0
    assert set(report["peaks"]) == {"sent", "evaluation", "train_step"}
    assert report["peaks"]["sent"]["predicted_gib"] == report["samplers"]["sent"]["predicted_gib"]
    assert report["peaks"]["train_step"]["predicted_gib"] == report["train_stage"]["estimate_gib"] > 0
    train = report["train_stage"]
    assert train["ok"] and train["lanes"] == 2 and train["skipped"] == [] and train["deterministic"]["rc"] is None


def toy_base(path: Path) -> Path:
    """A toy model saved as the samplers phase saves its random base."""
    from grpo.tools.synthetic import architecture_config, random_model_dir

    return random_model_dir(path, architecture_config("toy"), device="cpu")


@pytest.mark.slow
def test_an_out_of_memory_error_in_a_phase_child_fails_the_phase_with_its_figure(tmp_path):
    """A real allocation beyond what the machine can map, in the real call path of the samplers
    phase's child (SENT's call of 2**46 tokens: its per-completion uniforms alone are 2**48 bytes):
    the allocator raises, the child records the OOM with the bytes asked for and exits 1, and the
    phase is failed, its why the line with the figure; never passed."""
    tokens = 2**46
    run = device_check.Run(tmp_path / "out", 600, True, tmp_path / "site", {})
    (tmp_path / "out").mkdir()
    argv = ["bench/sampler_calls.py", "--params", device_check.SEED003, "--dry-run", "--call", "sent", "--base",
            str(toy_base(tmp_path / "base")), "--new-tokens", str(tokens)]
    run.phase("samplers", lambda limit: run.script("samplers", argv, limit))
    row, call = run.report["phases"]["samplers"], run.report["samplers"]
    assert row["status"] == "failed" and row["rc"] == 1 and not run.report["ok"]
    assert call["oom"] is True and call["requested_gib"] >= tokens * 4 / 2**30
    assert call["error"].startswith("RuntimeError") and "can't allocate memory" in call["error"]
    assert row["why"] == (f"sampler_calls: FAILED: out of memory in sent's call: asked for {call['requested_gib']} GiB, "
                          f"predicted {call['predicted_gib']} GiB")


def test_a_child_that_names_an_out_of_memory_error_fails_even_on_exit_0():
    """``outcome``: an OOM line fails a child whatever its exit code, and its why is the scripts'
    summary line (the one with the figures) before any other."""
    torch = pytest.importorskip("torch")
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 7.60 GiB")
    text = f"step 1\ntorch.OutOfMemoryError: {err}\nmore lines\n"
    assert device_check.outcome(0, text) == ("failed", 0, f"torch.OutOfMemoryError: {err}")
    summary = "sampler_calls: FAILED: out of memory in sent's call: asked for 2.5 GiB, cap 7.6 GiB"
    assert device_check.outcome(1, text + summary + "\nTraceback\n") == ("failed", 1, summary)
    assert device_check.outcome(0, "all good\n") == ("passed", 0, None)
    assert device_check.outcome(None, text)[2].startswith("killed at its time limit; torch.OutOfMemoryError")


def test_the_oom_figure_is_read_from_either_allocators_message():
    """bench/oom.py on the real exception types: CUDA's ``torch.OutOfMemoryError`` (c10's sizes) and
    the CPU allocator's ``RuntimeError`` from a real allocation that cannot be mapped."""
    torch = pytest.importorskip("torch")
    import oom

    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79 GiB")
    assert oom.oom_figure(cuda)["requested_gib"] == round(20 * 2**20 / 2**30, 3)
    with pytest.raises(RuntimeError) as raised:
        torch.empty(2**46, dtype=torch.float32)  # 2**48 bytes: beyond the address space
    figure = oom.oom_figure(raised.value)
    assert figure["oom"] and figure["requested_gib"] == 2**48 / 2**30 and figure["peak_allocated_gib"] is None
    assert oom.oom_figure(ValueError("Tried to allocate 2.00 GiB")) is None  # not an allocator's error
    assert oom.describe("SENT's call", {**figure, "predicted_gib": 7.9}, 7.6) == (
        f"out of memory in SENT's call: asked for {figure['requested_gib']} GiB, predicted 7.9 GiB, cap 7.6 GiB")


def test_the_budgets_come_from_the_cards_json_and_add_up_to_one_call():
    """Each phase's need is derived from the runs' JSON under docs/gpu-runs/ (the probe's is the
    H200's own seconds, the generation's counts the compile the H200 measured); the default limits
    cover their needs and, with the margin, fill at most the 570 s of one device call; a budget too
    small for the default phases is refused."""
    h200 = json.loads((device_budgets.H200_RUN / "device_check.json").read_text())
    gen = json.loads((device_budgets.H200_RUN / "call2-gen2.json").read_text())
    phases, default = device_check.PHASES, device_check.DEFAULT_PHASES
    assert phases["probe"].need_s == h200["phases"]["probe"]["seconds"]
    assert phases["generation"].need_s > gen["variants"]["dense-static-graph"]["first_call_s"]
    assert sum(phases[n].limit_s for n in default) + device_check.RUN_MARGIN_S <= device_check.DEFAULT_BUDGET_S <= 570
    assert all(phases[n].need_s <= phases[n].limit_s for n in phases)
    with pytest.raises(ValueError, match="train_stage would get"):
        device_budgets.budgets(default, 400, device_check.RUN_MARGIN_S, device_check.TRAIN_MARGIN_S)


def test_the_train_stages_limit_lets_every_part_start_at_the_h200s_times():
    """The train stage's need follows device_train's own rule: at the times the H200's figures
    predict for each part's start (the unbroken run alone, then the two lanes side by side), the
    clock of the phase's budget (its limit less TRAIN_MARGIN_S) lets each part start."""
    import time

    parts = device_budgets.train_parts(device_budgets.figures())
    budget = device_check.PHASES["train_stage"].limit_s - device_check.TRAIN_MARGIN_S
    u, lane = parts["unbroken"], device_budgets.LANE_FACTOR
    starts = {"unbroken_again": parts["setup"] + u, "killed": parts["setup"] + u,
              "resumed": parts["setup"] + u + lane * parts["killed"]}
    for part, at in starts.items():
        clock = device_train.Clock(budget, start=time.monotonic() - at)
        assert clock.fits(part, u), (part, at, clock.left())
    assert starts["resumed"] + lane * parts["resumed"] <= budget and starts["killed"] + lane * u <= budget


def test_usage_errors_are_one_line(tmp_path):
    done = subprocess.run([sys.executable, "bench/device_check.py", "run", str(tmp_path), "--phases", "probe,gpu"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"device_check: --phases/--limit: unknown gpu (phases: {', '.join(device_check.PHASES)})"]
    done = subprocess.run([sys.executable, "bench/device_check.py", "run", str(tmp_path), "--wheels", "no-such"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "--wheels no-such: no such folder" in done.stderr


def test_the_cut_wheel_keeps_the_named_libraries_and_a_record_that_matches(tmp_path):
    """A wheel with three native libraries, cut to one: the others are gone, and RECORD lists
    every file left with its sha256 and size (what pip checks a wheel against)."""
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    files = {"pkg/__init__.py": b"x = 1\n", "pkg/libkeep.so": b"keep" * 10, "pkg/libdrop_a.so": b"a" * 100,
             "pkg/libdrop_b.so": b"b" * 100, "pkg-1.0.dist-info/METADATA": b"Name: pkg\nVersion: 1.0\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/RECORD", "stale\n")
    device_check.cut_wheel(wheel, ("libkeep.so",))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
    assert names == {"pkg/__init__.py", "pkg/libkeep.so", "pkg-1.0.dist-info/METADATA", "pkg-1.0.dist-info/RECORD"}
    kept = {n: files[n] for n in names if n in files}
    assert sorted(record) == sorted([device_check.record_line(n, d) for n, d in kept.items()]
                                    + ["pkg-1.0.dist-info/RECORD,,"])


def test_a_report_missing_a_phase_part_does_not_conform():
    report = device_check.blank(device_check.SCHEMA)
    report.pop("nan_guard")
    errors = device_check.schema_errors(report, device_check.SCHEMA)
    assert "nan_guard: missing" in errors


def test_pack_prints_the_command_with_the_commit_of_this_tree():
    """The device machine's git is stale: the command pack prints passes the commit, HEAD with
    +dirty when the tree has changes."""
    commit = device_check.git_commit()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert commit == head + ("+dirty" if dirty else "") and re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit)
    assert device_check.run_command(".device-wheels", commit) == (
        f'there: python3 bench/device_check.py run "$OUT" --wheels .device-wheels --commit {commit}   '
        "(carry .device-wheels)")


def test_the_report_names_the_commit_passed_or_else_git(tmp_path):
    passed = device_check.Run(tmp_path, 540, True, tmp_path / "site", {}, "0123abc+dirty").report
    assert (passed["commit"], passed["commit_source"]) == ("0123abc+dirty", "passed")
    read = device_check.Run(tmp_path, 540, True, tmp_path / "site", {}).report
    assert (read["commit"], read["commit_source"]) == (device_check.git_commit(), "git")


def test_the_default_phases_come_first_and_every_phase_has_a_runner():
    names, default = list(device_check.PHASES), list(device_check.DEFAULT_PHASES)
    assert names[:len(default)] == default and default[0] == "probe" and default[-1] == "train_stage"
    assert set(device_check.RUNNERS) == set(names) - {"probe"}


def test_without_makes_a_module_unimportable_for_the_phases(tmp_path):
    """``--without dvclive``: the children's PYTHONPATH starts with a package whose import raises
    ModuleNotFoundError, so ``import dvclive`` fails through the real import machinery (here, where
    dvclive is installed) and the step loggers go on without it."""
    run = device_check.Run(tmp_path, 570, True, tmp_path / "site", {}, None, ("dvclive",))
    assert run.report["without"] == ["dvclive"]
    assert run.env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site" / "without")
    code = ("import importlib.util, logging, pathlib\n"
            "assert importlib.util.find_spec('dvclive') is not None\n"
            "from grpo.training.step_loggers import dvclive_logger\n"
            "logging.basicConfig()\n"
            f"print(dvclive_logger(pathlib.Path({str(tmp_path / 'm')!r})))\n"
            "import dvclive\n")
    done = subprocess.run([sys.executable, "-c", code], env=run.env, capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "(None, None)" and "dvclive is not importable" in done.stderr
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: No module named 'dvclive' (hidden by device_check --without)")


def test_a_phase_that_would_not_finish_in_what_is_left_is_skipped(tmp_path):
    """On a card a phase starts only when the budget left holds its expected time."""
    run = device_check.Run(tmp_path, 100, False, tmp_path / "site", {})
    ran = []
    step, nf4 = device_check.PHASES["step"], device_check.PHASES["nf4_rows"]
    assert step.need_s > 100 - device_check.RUN_MARGIN_S > nf4.limit_s
    run.phase("step", lambda limit: ran.append(limit) or ("passed", 0, None))
    row = run.report["phases"]["step"]
    assert ran == [] and row["status"] == "skipped" and f"under the {step.need_s:.0f} s it needs" in row["why"]
    run.phase("nf4_rows", lambda limit: ran.append(limit) or ("passed", 0, None))
    assert ran == [nf4.limit_s] and run.report["phases"]["nf4_rows"]["status"] == "passed" and run.report["ok"]


def test_the_schema_check_names_each_departure_from_a_hand_made_schema():
    schema = {"a": "int: a count", "b": "number?: a figure or null", "c": {"d": "list[str]: names"},
              "e": [{"f": "bool: a flag"}]}
    good = {"a": 2, "b": None, "c": {"d": ["x"]}, "e": [{"f": False}, {"f": True}]}
    assert report_schema.schema_errors(good, schema) == []
    assert report_schema.schema_errors({**good, "b": 0.5}, schema) == []
    cases = {
        "a: missing": {k: v for k, v in good.items() if k != "a"},
        "z: not in the schema": {**good, "z": 1},
        "a: expected int, got str '2'": {**good, "a": "2"},
        "a: expected int, got bool True": {**good, "a": True},
        "a: null, expected int": {**good, "a": None},
        "b: nan is not a finite number": {**good, "b": float("nan")},
        "c.d: expected a list of strings, got ['x', 1]": {**good, "c": {"d": ["x", 1]}},
        "c: expected an object, got list": {**good, "c": []},
        "e[1].f: expected bool, got int 1": {**good, "e": [{"f": False}, {"f": 1}]},
        "e[0].g: not in the schema": {**good, "e": [{"f": False, "g": 0}]},
        "e: expected a list, got dict": {**good, "e": {"f": True}},
    }
    for error, bad in cases.items():
        assert report_schema.schema_errors(bad, schema) == [error], error
