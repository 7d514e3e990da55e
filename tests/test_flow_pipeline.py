"""``flows.pipeline``: the name of a workspace's Prefect concurrency slot (the flow run end to end:
tests/test_pipeline.py, tests/test_flow_workspace.py; the slot held on a work pool: tests/test_flow_deploy.py)."""

from __future__ import annotations

import os

from flows.pipeline import slot_name


def test_slot_name_is_per_workspace_path(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert slot_name(tmp_path / "a") == slot_name(tmp_path / "link") != slot_name(tmp_path)
    assert slot_name(tmp_path).startswith("grpo-workspace-")
