"""grpo.core.dvcfile: the stages of this repo's dvc.yaml as every reader sees them, a file with the
forms DVC accepts, and the walk up to a workspace or a DVC repository."""

from __future__ import annotations

import yaml

from grpo.core.dvcfile import DVC_DIR, Stage, find_root, read_stages

from .conftest import REPO


def test_the_repos_stages_in_file_order_with_what_each_reads_and_writes():
    stages = read_stages(REPO / "dvc.yaml")
    assert list(stages) == ["check_params", "prepare_data", "prepare_model", "sent", "baseline_eval", "train",
                            "final_eval", "report"]
    assert [name for name, s in stages.items() if s.guard] == ["check_params"]  # `meta: {guard: true}`
    train = stages["train"]
    assert train.cmd == "python -m tasks.train" and "tasks/train.py" in train.deps
    assert train.params == ("train", "lora", "decode", "model.path", "model.quantization", "model.dtype",
                            "model.gradient_checkpointing") and not train.all_params
    assert train.outs == ("models/adapter", "metrics/train.json", "metrics/time/train.json",
                          "metrics/train/metrics.json", "metrics/train/plots/metrics")  # outs, metrics, plots
    assert train.uncached == train.outs[1:]
    assert stages["report"].all_params and stages["report"].params == ()  # `- params.yaml:`: the whole file
    assert not any(s.templated for s in stages.values())


def test_a_file_in_every_form_dvc_accepts(tmp_path):
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "b": {"cmd": ["echo 1", "echo 2"], "deps": ["in.txt", {"big.bin": {"hash": "md5"}}],
              "params": ["x.y", {"params.yaml": ["z"]}, {"other.yaml": ["w"]}],
              "outs": [{"out": {"cache": False, "persist": True}}, "kept"], "plots": [{"p.tsv": None}]},
        "a": {"foreach": [1, 2], "do": {"cmd": "echo ${item}"}},
        "g": {"cmd": "check", "meta": {"guard": True}, "outs": ["ok"]}, "m": {"cmd": "x", "meta": "a note"},
        "empty": None,
    }}, sort_keys=False))
    stages = read_stages(tmp_path / "dvc.yaml")
    assert list(stages) == ["b", "a", "g", "m", "empty"]
    assert stages["g"].guard and not stages["m"].guard and not stages["b"].guard
    assert stages["b"] == Stage(cmd=["echo 1", "echo 2"], deps=("in.txt", "big.bin"), outs=("out", "kept", "p.tsv"),
                                uncached=("out",), params=("x.y", "z"))  # other.yaml's keys are not params.yaml's
    assert stages["a"].templated and stages["empty"] == Stage()
    (tmp_path / "dvc.yaml").write_text("# no stages yet\n")
    assert read_stages(tmp_path / "dvc.yaml") == {}


def test_the_nearest_workspace_or_dvc_repository_at_or_above_a_path(tmp_path):
    repo, sub = tmp_path / "repo", tmp_path / "repo" / "sub" / "deeper"
    sub.mkdir(parents=True)
    (repo / DVC_DIR).mkdir()
    (repo / "dvc.yaml").write_text("stages: {}\n")
    (repo / "sub" / "dvc.yaml").write_text("stages: {}\n")  # a second dvc.yaml inside the same repository
    assert find_root(sub) == repo / "sub" and find_root(repo) == repo
    assert find_root(sub, DVC_DIR) == repo  # DVC's own root: the .dvc folder, whichever dvc.yaml
    (tmp_path / "lonely").mkdir()
    (tmp_path / "lonely" / DVC_DIR).write_text("a file, not DVC's folder")
    assert find_root(tmp_path / "lonely", DVC_DIR) != tmp_path / "lonely"
