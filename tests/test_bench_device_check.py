"""bench/device_check.py on the CPU: the dry run of every phase, the time limits, the cut wheel.

The GPU machine is lent now and then, for minutes: the check must work the first time there.
Here it runs as it runs there (the same children, limits and JSON), at toy sizes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import device_check  # noqa: E402


def run_check(out: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/device_check.py", "run", str(out), "--dry-run", *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_dry_run_passes_every_phase_and_writes_three_files_that_conform(tmp_path):
    """Every phase passes on the CPU, the JSON conforms to SCHEMA (each phase's part filled in by
    its own script), and OUT holds at most the 8 files a device call brings back."""
    done = run_check(tmp_path / "out")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert device_check.schema_errors(report, device_check.SCHEMA) == []
    assert report["finished"] and report["ok"] and report["dry_run"]
    assert {name: row["status"] for name, row in report["phases"].items()} == dict.fromkeys(device_check.PHASES, "passed")
    assert report["tests"]["passed"] > 0 and report["tests"]["failed"] == 0
    assert report["nan_guard"]["ok"] and report["nan_guard"]["lr_advanced_on_skip"] is False
    assert report["update"]["estimate_gib"] > 0 and report["nf4_rows"]["rows"]
    assert report["step"]["ours"]["steps"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device_check.json", "device_check.log", "pytest.xml"]
    log = (tmp_path / "out" / "device_check.log").read_text()
    assert all(f"===== {name}: " in log for name in device_check.PHASES)


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
        "device_check: --phases/--limit: unknown gpu (phases: probe, tests, update, nan_guard, nf4_rows, step)"]
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
