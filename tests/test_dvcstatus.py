"""Which stages ``dvc repro`` would run (``grpo.tools.dvcstatus``, for ``grpo check``): the stages downstream of
changed ones, the stages reading a changed params key, ``dvc status --json``'s entries in a few words, and
``describe`` over a real DVC workspace before and after a repro, with a preset's keys and with edits."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from grpo.core.dvcfile import Stage
from grpo.tools.dvcstatus import _why, describe, downstream, dvc_error_line, dvc_status, flat_keys, stages_reading

GRAPH = {
    "prepare": Stage(outs=("data/raw",), params=("data",)),
    "model": Stage(outs=("models/base",), params=("model.name",)),
    "train": Stage(deps=("data/raw/train.jsonl", "models/base"), outs=("models/adapter",),
                   params=("train", "model.path")),
    "evaluate": Stage(deps=("models/adapter", "data"), outs=("metrics/eval.json",), params=("evaluate",)),
    "report": Stage(deps=("metrics",), outs=("reports/report.md",), params=("report",)),
}


def test_downstream_follows_outputs_into_inputs_in_file_order():
    """A dep inside an output folder (data/raw/train.jsonl) or a folder holding an output (data,
    metrics) counts; the changed stages themselves are not repeated; nothing is downstream of report."""
    assert downstream(GRAPH, {"prepare"}) == ["train", "evaluate", "report"]
    assert downstream(GRAPH, {"model"}) == ["train", "evaluate", "report"]
    assert downstream(GRAPH, {"train", "model"}) == ["evaluate", "report"]
    assert downstream(GRAPH, {"evaluate"}) == ["report"]
    assert downstream(GRAPH, {"report"}) == []


def test_a_guard_passes_nothing_downstream():
    """A guard (``meta: {guard: true}``, as check_params) writes the same bytes whenever it succeeds: its
    running re-runs no stage that reads its output, while what it guards still passes changes on."""
    guarded = {"check": Stage(outs=("metrics/ok.json",), all_params=True, guard=True),
               **{name: Stage(deps=(*stage.deps, "metrics/ok.json"), outs=stage.outs, params=stage.params)
                  for name, stage in GRAPH.items()}}
    assert downstream(guarded, {"check"}) == []
    assert downstream(guarded, {"check", "prepare"}) == ["train", "evaluate", "report"]
    unguarded = {**guarded, "check": Stage(outs=("metrics/ok.json",), all_params=True)}
    assert downstream(unguarded, {"check"}) == list(GRAPH)


def test_flat_keys_are_dotted_leaves_at_any_depth():
    params = {"train": {"rewards": {"correctness": 1.0}, "optimizer": {"lr": 5e-4}, "order_options": {}}, "seed": 3}
    assert flat_keys(params) == {"train.optimizer.lr": 5e-4, "train.rewards.correctness": 1.0,
                                 "train.order_options": {}, "seed": 3}


def test_stages_reading_a_key_or_its_whole_section():
    assert stages_reading(GRAPH, ["train.optimizer.lr"]) == ["train"]
    assert stages_reading(GRAPH, ["model.path", "data.train_size"]) == ["prepare", "train"]
    assert stages_reading(GRAPH, ["model.name"]) == ["model"]
    assert stages_reading(GRAPH, ["model.dtype", "training.lr"]) == []  # neither a key read nor a section


def test_a_stages_status_in_a_few_words():
    """``dvc status --json`` entries as DVC 3 prints them: code (a .py or a path under src/, tasks/,
    flows/), params by key, data inputs (three named, then a count), outputs missing or modified, and
    DVC's own phrases; each said once."""
    assert _why([{"changed deps": {"src/grpo/training/trainer.py": "modified", "params.yaml": {"train.optimizer.lr": "modified",
                                                                                     "lora.rank": "new"}}}]) \
        == "code; params lora.rank, train.optimizer.lr"
    assert _why([{"changed deps": {f"data/{i}.jsonl": "modified" for i in range(5)}},
                 {"changed outs": {"a.txt": "deleted"}}]) \
        == "inputs data/0.jsonl, data/1.jsonl, data/2.jsonl (+2 more); outputs missing"
    assert _why([{"changed outs": {"a.txt": "modified"}}, "always changed", "always changed"]) \
        == "outputs modified; always changed"
    assert _why([{"changed checksum": True}]) == "changed checksum"
    assert _why([]) == "changed"


def _git_dvc_workspace(root) -> None:
    """Stages a (in.txt, x.y -> a.txt), b (a.txt -> b.txt) and c (z -> c.txt) in a git + DVC repo."""
    stages = {
        "a": {"cmd": "cp in.txt a.txt", "deps": ["in.txt"], "params": ["x.y"], "outs": ["a.txt"]},
        "b": {"cmd": "cp a.txt b.txt", "deps": ["a.txt"], "outs": ["b.txt"]},
        "c": {"cmd": "echo c > c.txt", "params": ["z"], "outs": ["c.txt"]},
    }
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (root / "params.yaml").write_text(yaml.safe_dump({"x": {"y": 1}, "z": 2}))
    (root / "in.txt").write_text("1\n")
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"],
                [sys.executable, "-m", "dvc", "config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)


@pytest.mark.slow
def test_describe_a_real_workspace(tmp_path_factory):
    """Through a real ``dvc status``: every stage before a repro, nothing after; a preset's key says
    which stage reads it (and what follows from it); an edited param, a deleted output and an edited
    input each in their words; outside a DVC repository the reason in one line."""
    tmp_path = tmp_path_factory.mktemp("workspace")
    _git_dvc_workspace(tmp_path)
    before = describe(tmp_path)
    assert before[0] == "dvc: `dvc repro` would run 3 of 3 stages:" and [x.split()[0] for x in before[1:]] == \
        ["a", "b", "c"]
    subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], cwd=tmp_path, check=True, capture_output=True)
    assert describe(tmp_path) == ["dvc: up to date: `dvc repro` would run nothing"]
    assert describe(tmp_path, ["x.y"]) == ["dvc: `dvc repro` would run 1 of 3 stages:",
                                           "  a  this file changes x.y",
                                           "  and, when an input they take from those changes: b"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"x": {"y": 5}, "z": 2}))
    (tmp_path / "in.txt").write_text("2\n")
    (tmp_path / "c.txt").unlink()
    assert describe(tmp_path, ["z"]) == ["dvc: `dvc repro` would run 2 of 3 stages:",
                                         "  a  params x.y; inputs in.txt",
                                         "  c  outputs missing; this file changes z",
                                         "  and, when an input they take from those changes: b"]
    reason = dvc_status(tmp_path_factory.mktemp("plain"))
    assert isinstance(reason, str) and reason.startswith("dvc status failed: ") and "\n" not in reason


def test_dvcs_error_is_its_message_and_the_yaml_problem_not_the_help_link():
    """DVC's output for a params file with a repeated key (its last line: a link)."""
    lines = ["ERROR: unable to read: 'params.yaml', YAML file structure is corrupted: while constructing a mapping",
             '  in "<unicode string>", line 2, column 3', 'found duplicate key "steps" with value "2" (original '
             'value: "1")', '  in "<unicode string>", line 3, column 3', "To suppress this check see:",
             "    https://yaml.dev/doc/ruamel.yaml/api/#Duplicate_keys"]
    assert dvc_error_line(lines) == ("unable to read: 'params.yaml', YAML file structure is corrupted: while "
                                     'constructing a mapping at line 2, column 3 found duplicate key "steps" with '
                                     'value "2" (original value: "1") at line 3, column 3')


def test_dvcs_busy_error_names_the_run_holding_the_workspace_once():
    """DVC's output when another ``dvc repro`` holds a stage's five outputs: the PID once."""
    holder = "  (PID 18039): /venv/lib/python3.11/site-packages/dvc/__main__.py repro"
    lines = ["ERROR: '/ws/o/5' is busy, it is being blocked by:", *[holder] * 5, "",
             "If there are no processes with such PIDs, you can manually remove '/ws/.dvc/tmp/rwlock' and try again."]
    assert dvc_error_line(lines) == (
        "'/ws/o/5' is busy, it is being blocked by: (PID 18039): /venv/lib/python3.11/site-packages/dvc/__main__.py "
        "repro If there are no processes with such PIDs, you can manually remove '/ws/.dvc/tmp/rwlock' and try again.")


@pytest.mark.slow
def test_a_running_repro_is_named_once(tmp_path):
    """``describe`` beside a real ``dvc repro`` whose stage holds five outputs: one line naming its
    PID once; the repro and its stage are killed after."""
    import os
    import signal

    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    outs = [f"o/{i}" for i in range(5)]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"a": {
        "cmd": f"sleep 60 && mkdir -p o && touch {' '.join(outs)}", "outs": outs}}}))
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # its group: the stage's shell too
    try:
        rwlock = tmp_path / ".dvc" / "tmp" / "rwlock"
        for _ in range(300):
            if rwlock.exists() and "write" in rwlock.read_text():
                break
            __import__("time").sleep(0.1)
        (line,) = describe(tmp_path)
        assert line.startswith("dvc: dvc status failed: ") and " is busy, it is being blocked by: " in line
        assert line.count(f"(PID {proc.pid})") == 1 and line.endswith("and try again.: no stage status")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_a_file_dvc_refuses_is_one_line_with_dvcs_reason(tmp_path):
    """Through a real ``dvc status``: a repeated key in dvc.yaml or params.yaml, and dvc.yaml that
    is not YAML, each one line saying what and where."""
    _git_dvc_workspace(tmp_path)
    dvc_yaml = (tmp_path / "dvc.yaml").read_text()
    (tmp_path / "dvc.yaml").write_text(dvc_yaml.replace("  a:\n", "  a:\n    cmd: echo twice\n"))
    (line,) = describe(tmp_path)
    assert line.startswith("dvc: dvc status failed: './dvc.yaml' is invalid.") and \
        'Found duplicate key "cmd" with value "cp in.txt a.txt" (original value: "echo twice")' in line
    (tmp_path / "dvc.yaml").write_text(dvc_yaml)
    (tmp_path / "params.yaml").write_text("x:\n  y: 1\n  y: 2\nz: 2\n")
    (line,) = describe(tmp_path)
    assert line.startswith("dvc: dvc status failed: unable to read: 'params.yaml'") and \
        'found duplicate key "y"' in line and "http" not in line
    (tmp_path / "dvc.yaml").write_text("stages: [\n")
    assert describe(tmp_path) == [f"dvc: {tmp_path / 'dvc.yaml'}:2: not valid YAML (while parsing a flow node: "
                                  "expected the node content, but found '<stream end>', column 1): no stage status"]
