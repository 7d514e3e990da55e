"""bench/device_check.py on the CPU: the dry run of every phase, the time limits, the cut wheel.

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
import device_check  # noqa: E402
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
    assert train["ok"] and train["resumed_from"] == 1 and train["skipped"] == []
    assert train["unbroken_pair"] == {"same_bytes": True, "max_abs_diff": 0.0}  # the CPU: equal bytes
    assert train["deterministic_why"].startswith("--deterministic always; ran 2 of 2")
    assert train["deterministic_pair"]["same_bytes"] and train["deterministic_step_ratio"] > 0
    rules = report["rules"]
    assert rules["default_from"] == "update" and rules["default"] == report["update"]
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


def test_usage_errors_are_one_line(tmp_path):
    done = subprocess.run([sys.executable, "bench/device_check.py", "run", str(tmp_path), "--phases", "probe,gpu"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "device_check: --phases/--limit: unknown gpu (phases: probe, train_stage, samplers, generation, update, context, "
        "rules, tests, nan_guard, nf4_rows, step)"]
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


def test_the_default_phases_fit_one_device_call_and_each_needs_less_than_its_limit():
    """The default phases come first in ``PHASES`` and their limits, with the margin each phase
    leaves, fit the default budget (570 s: a device call runs at most 600 s), so each gets its whole
    limit; every phase's need is within its limit."""
    names, default = list(device_check.PHASES), list(device_check.DEFAULT_PHASES)
    assert names[:len(default)] == default and default[0] == "probe"
    assert sum(device_check.PHASES[n].limit_s for n in default) + device_check.RUN_MARGIN_S <= device_check.DEFAULT_BUDGET_S
    assert device_check.DEFAULT_BUDGET_S <= 570
    assert all(p.need_s <= p.limit_s for p in device_check.PHASES.values())
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
            "from grpo.step_loggers import dvclive_logger\n"
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
    run.phase("step", lambda limit: ran.append(limit) or ("passed", 0, None))  # needs 250 s of the 100 left
    row = run.report["phases"]["step"]
    assert ran == [] and row["status"] == "skipped" and "under the 120 s it needs" in row["why"]
    run.phase("nf4_rows", lambda limit: ran.append(limit) or ("passed", 0, None))
    assert ran == [30] and run.report["phases"]["nf4_rows"]["status"] == "passed" and run.report["ok"]


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
