"""``scripts/apply_preset.py``: a preset put over params.yaml keeps it complete, with its comments, and
a bad preset is refused in one line, leaving the file as it was."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from grpo.config.params import load_params

from .conftest import REPO
from .helpers import _keys


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
@pytest.mark.parametrize("preset", ["presets/seed003.yaml", "presets/seed001.yaml"])
def test_apply_preset_keeps_params_complete_and_takes_the_preset_values(preset, tmp_path):
    target = tmp_path / "params.yaml"
    target.write_text((REPO / "params.yaml").read_text())
    proc = subprocess.run([sys.executable, "scripts/apply_preset.py", preset, str(target)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    after, overrides = yaml.safe_load(target.read_text()), yaml.safe_load((REPO / preset).read_text())
    assert _keys(after) == _keys(yaml.safe_load((REPO / "params.yaml").read_text()))
    from grpo.tools.dvcstatus import flat_keys

    got = flat_keys(after)
    for key, value in flat_keys(overrides).items():  # every leaf the preset names, at any depth
        assert got[key] == value, key
    assert "# Embedded default" in target.read_text()  # comments kept
    load_params(target)


def test_apply_preset_refuses_a_bad_preset_and_writes_nothing(tmp_path):
    target, bad = tmp_path / "params.yaml", tmp_path / "bad.yaml"
    target.write_text((REPO / "params.yaml").read_text())
    bad.write_text("train:\n  learning_rate: 0.1\n")
    proc = subprocess.run([sys.executable, "scripts/apply_preset.py", str(bad), str(target)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "train.learning_rate: unknown key" in proc.stderr
    assert target.read_text() == (REPO / "params.yaml").read_text()


def test_a_missing_preset_is_one_line_that_lists_the_presets_there_are(tmp_path):
    target = tmp_path / "params.yaml"
    target.write_text((REPO / "params.yaml").read_text())
    proc = subprocess.run([sys.executable, "scripts/apply_preset.py", "presets/nope.yaml", str(target)], cwd=REPO,
                          capture_output=True, text=True)
    there = sorted(f"presets/{p.name}" for p in (REPO / "presets").glob("*.yaml"))
    assert proc.returncode == 2 and there
    assert proc.stderr == f"apply_preset: error: presets/nope.yaml: not found; the presets: {', '.join(there)}\n"
    assert target.read_text() == (REPO / "params.yaml").read_text()
