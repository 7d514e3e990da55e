"""``grpo.tools.check_report``: ``grpo check``'s report for resolved params (settings, splits, device,
DVC status, decode, rollouts, the memory estimate, the saved-model engines and a verdict per stage)
and ``grpo doctor --params``'s stage needs. The params are resolved as the command resolves them
(``grpo.tools.cli.resolve_params``; a bad file's one line: tests/test_cli.py; the estimate's exact
parts: tests/test_memory.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from grpo.core.jsonio import write_jsonl
from grpo.tools import check_report, cli
from grpo.tools.memory import CUDA_CONTEXT

from .conftest import REPO

GIB = 2**30


def report(capsys, params, device: str | None = None, gpu_memory: float | None = None,
           prompt_tokens: int | None = None) -> str:
    """``check_report.check``'s output for the params file ``params`` (exit code 0 asserted)."""
    code = check_report.check(cli.resolve_params(params), device, gpu_memory, prompt_tokens)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.parametrize("params", ["params.yaml", "presets/seed003.yaml", "presets/seed001.yaml"])
def test_check_prints_settings_device_dvc_and_the_estimate(params, capsys):
    out = report(capsys, REPO / params, prompt_tokens=100)
    lines = out.splitlines()
    assert lines[0].startswith("params: ") and lines[0].endswith(": valid")
    assert any(line.startswith("device: ") for line in lines)
    assert any(line.startswith("dvc: ") for line in lines)
    assert "memory: one training step on" in out
    for term in ("weights", "LoRA + AdamW", "KV cache", "activations", "generation total", "training total", "peak"):
        assert any(line.strip().startswith(term) for line in lines), term
    assert any(line.strip().startswith("measured") for line in lines)
    if params != "params.yaml":  # a preset is put over params.yaml: the stages it changes are named
        assert "this file changes" in out and "model.name" in out


def test_check_for_a_gpu_names_seed003s_measurement(capsys):
    out = report(capsys, REPO / "presets/seed003.yaml", device="cuda", prompt_tokens=128)
    assert "on cuda (bfloat16 compute)" in out and "dense 4-bit copies" not in out
    assert "seed 003's step" in out and "not measured yet" in out


def test_estimate_without_a_config_says_so(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "someone/unknown-model", "path": str(tmp_path / "none")}}))
    out = report(capsys, path)
    assert "memory: no estimate: the estimate needs the model's config.json" in out
    assert check_report.stage_needs(cli.resolve_params(path).params, tmp_path, 8 * GIB) == {}  # doctor: no need known


def test_a_preset_is_estimated_for_its_own_model_where_another_was_prepared(tiny_model_dir, tiny_problems, tmp_path,
                                                                           capsys):
    """A workspace where the default pipeline ran: prepare_model wrote models/base (with its
    manifest.json) for params.yaml's model, prepare_data the arithmetic problems; ``check`` of seed
    003 there estimates the 1.5B model the preset names, not the directory (nor its prompts with
    that model's tokenizer), with the engine at ``--gpu-memory 8`` and 6; ``check`` of params.yaml
    still reads the directory and the problems."""
    import shutil

    from grpo.model.base_model import resolve_base_model

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"model": {"name": str(tiny_model_dir),
                                                                    "path": "models/base"}}))
    resolve_base_model(str(tiny_model_dir), tmp_path / "models" / "base")  # as the prepare_model stage does
    write_jsonl(tmp_path / "data" / "raw" / "train.jsonl", tiny_problems)  # as prepare_data does
    (tmp_path / "data" / "raw" / "stats.json").write_text(json.dumps({"source": "arithmetic"}))
    (tmp_path / "presets").mkdir()
    shutil.copy(REPO / "presets" / "seed003.yaml", tmp_path / "presets" / "seed003.yaml")
    out = report(capsys, tmp_path / "presets" / "seed003.yaml", device="cuda", gpu_memory=8)
    lines = [line.strip() for line in out.splitlines()]
    # not the tiny model's tokenizer on the arithmetic problems: the preset's prompt length is assumed
    assert f"prompt {check_report.DEFAULT_PROMPT_TOKENS} tokens (assumed" in out
    model = next(line for line in lines if line.startswith("model: "))
    assert "grpo.tools.synthetic architecture 'qwen2-1.5b'" in model and f"models/base holds {tiny_model_dir}" in model
    assert "hidden 1536" in model and "28 layers" in model
    # both phases with the engine, its arithmetic and the verdict for the card
    assert "engine: train.rollouts.engine_weights auto -> nf4 (auto: dense needs 3.95 GiB > the budget 0.96 GiB)" in out
    assert any(line.startswith("KV cache of one step") and "10,240 tokens (16 completions x 640" in line
               and "x 28 KiB/token (2 x 28 layers x 2 kv heads x 128 x 2 B)" in line for line in lines)
    assert any(line.startswith("budget") and "train.rollouts.gpu_memory_utilization 0.12 x 8.00 GiB" in line for line in lines)
    assert any(line.startswith("vLLM engine, awake") and "generate" in line for line in lines)
    assert any(line.startswith("vLLM engine, asleep") and "train" in line for line in lines)
    peak = next(line for line in lines if line.startswith("peak"))
    assert float(peak.split()[1]) <= 3.3  # seed 003 with the nf4 engine: the update's 2 micro-batches of 8 rows, 3.22
    assert "card 8.00 GiB: fits: peak" in out
    out = report(capsys, tmp_path / "presets" / "seed003.yaml", device="cuda", gpu_memory=4.1, prompt_tokens=128)
    assert "card 4.10 GiB: does not fit: the engine's budget 503.8 MiB < its needs 714.6 MiB (nf4); turn " \
           "train.rollouts.gpu_memory_utilization: between 0.18 and 0.43" in out
    out = report(capsys, tmp_path / "params.yaml", device="cuda")
    model = next(line for line in out.splitlines() if line.strip().startswith("model: "))
    assert f"{tmp_path / 'models' / 'base' / 'config.json'}" in model and "hidden 64" in model
    assert f"(the longest prompt of {tmp_path / 'data' / 'raw' / 'train.jsonl'})" in out


@pytest.mark.parametrize(("gib", "fits"), [(24.0, True), (1.0, False)])
def test_check_for_a_card_prints_the_saved_model_engines_and_a_verdict_per_stage(gib, fits, capsys):
    """``--device cuda --gpu-memory GIB``: SENT's and the evaluations' engines bounded to one call
    (seed 003: 16 prompts x 8 samples -> 128; 64 x 1 greedy -> 64), then one verdict line a
    stage: sent, the evaluations, train."""
    out = report(capsys, REPO / "presets/seed003.yaml", device="cuda", gpu_memory=gib, prompt_tokens=128)
    lines = out.splitlines()
    assert "memory: the saved-model engines on cuda, one generation call each, estimated" in lines
    assert any(line.startswith("  sent: the base in bfloat16; max_num_seqs 128 (sent.batch_prompts 16 x num_samples 8")
               for line in lines)
    assert any(line.startswith("  baseline_eval, final_eval: the policy exported dense in bfloat16; max_num_seqs 64 ")
               for line in lines)
    start = lines.index("verdict per stage:") + 1
    stages = [line for line in lines[start:next(i for i, line in enumerate(lines) if line.startswith("time: "))]
              if not line.startswith("    ")]  # the modelled times follow; the decode loop's lines are indented under theirs
    loops = [line for line in lines[start:] if line.startswith("    without vLLM")]
    assert len(loops) == 2 and all("the decode loop" in line for line in loops), loops
    assert [line.split(":")[0].strip() for line in stages] == ["sent", "baseline_eval, final_eval", "train"]
    card = f"card {gib:.2f} GiB: "
    verdict = "fits: " if fits else "does not fit: "
    assert all(line.split(": ", 1)[1].startswith(card + verdict) for line in stages), stages
    train = cli.resolve_params(REPO / "presets/seed003.yaml").params.train  # the rule the preset resolves to
    rule = f"; estimated for train.loss.entropy_rule {train.loss.entropy_rule} (top_quantile {train.loss.rule_options().top_quantile})"
    assert stages[-1].endswith(rule), stages[-1]


def test_check_says_what_each_training_process_samples_with(tmp_path, capsys):
    """The train stage's rule (``grpo.rollout.rollout_backends.uses_engine``): with vLLM installed every process runs
    an engine of its own; the decode loop with ``rollout_backend: transformers`` (the stage test
    with 2 real processes compares this line with its log: tests/test_distributed.py)."""
    import importlib.util

    from grpo.rollout.rollout_backends import uses_engine

    for backend, processes in (("auto", 2), ("transformers", 2), ("vllm", 1)):
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(
            {"train": {"distribution": {"num_processes": processes}, "rollouts": {"prompts_per_step": 4, "backend": backend}}}))
        out = report(capsys, tmp_path / "p.yaml")
        line = next(x.strip() for x in out.splitlines() if x.strip().startswith("rollouts:"))
        who = "the process" if processes == 1 else f"each of {processes} processes"
        if uses_engine(backend):
            assert line.startswith(f"rollouts: {who}: a vLLM engine of its own holding the policy (dense weights)")
        else:
            assert line.startswith(f"rollouts: {who}: the decode loop on the policy (transformers)")
    assert uses_engine("auto") == (importlib.util.find_spec("vllm") is not None)


def test_check_names_the_device_it_estimates_for_and_this_machine(monkeypatch, capsys):
    """``device`` cuda on a CPU machine: the estimate is for CUDA, the machine is named apart."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("GRPO_DEVICE", raising=False)
    out = report(capsys, REPO / "params.yaml", device="cuda", prompt_tokens=100)
    (line,) = [x for x in out.splitlines() if x.startswith("device: ")]
    assert line.startswith("device: estimating for cuda (--device); this machine: CPU: ")
    assert " cores" in line
    assert "card: unknown: --gpu-memory GIB for the engine's budget and a verdict" in out  # no card here to read
    out = report(capsys, REPO / "params.yaml", prompt_tokens=100)
    (line,) = [x for x in out.splitlines() if x.startswith("device: ")]
    assert line.startswith("device: estimating for this machine: CPU: ")


def test_check_prints_the_splits_of_seed003(capsys):
    out = report(capsys, REPO / "presets/seed003.yaml", prompt_tokens=100)
    splits = [line.strip() for line in out.splitlines() if line.startswith("  splits") or line.startswith(" " * 12)]
    p = cli.resolve_params(REPO / "presets/seed003.yaml").params.data
    assert f"splits    training {p.train_size} of {p.train_size} asked" in out
    assert any(line.startswith(f"validation {p.val_size} of {p.val_size} asked (GSM8K's train split after its first "
                               f"{p.train_size} rows") for line in splits)


def test_card_bytes_say_where_the_card_size_came_from():
    assert check_report.card_bytes(None, "cpu") == (None, "none (a CPU estimate)")
    assert check_report.card_bytes(8.0, "cpu") == (None, "none (a CPU estimate): --gpu-memory applies to --device cuda")
    assert check_report.card_bytes(7.5, "cuda") == (int(7.5 * GIB), "7.5 GiB (--gpu-memory)")


def test_the_decode_line_names_the_engine_where_one_samples():
    p = cli.resolve_params(REPO / "params.yaml").params
    assert check_report.decode_line(p, "cpu", engine=True).startswith(
        "train: a vLLM engine samples (train.rollouts.backend); sent and evaluate (where the decode loop samples)")
    assert not check_report.decode_line(p, "cpu", engine=False).startswith("train: a vLLM engine samples")


def test_the_estimate_assumes_the_default_prompt_the_help_names(capsys):
    """``--prompt-tokens``' help names the length ``prompt_for`` assumes where no prompt can be measured
    (``grpo.tools.cli`` imports no torch, so its help cannot import the constant)."""
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    assert f"else {check_report.DEFAULT_PROMPT_TOKENS})" in " ".join(capsys.readouterr().out.split())
    p = cli.resolve_params(REPO / "params.yaml").params
    assert check_report.prompt_for(p, REPO / "no-workspace", None) == (check_report.DEFAULT_PROMPT_TOKENS,
                                                                      "assumed; --prompt-tokens N to set")
    assert check_report.prompt_for(p, REPO / "no-workspace", 77) == (77, "--prompt-tokens")


def test_stage_needs_on_a_card_are_the_engines_shares_and_the_train_peak():
    """``grpo doctor --params``' figures (tests/test_engine_preflight.py holds free memory to them):
    on a card reporting 7.6 GiB, seed 003's evaluations need their engine share at its start,
    0.78 x 7.6 = 5.93 GiB, beside the stage's own CUDA context (``grpo.tools.memory.CUDA_CONTEXT``),
    above SENT's share (0.85 x 7.6 = 6.46 GiB) and the train step's estimated peak."""
    res = cli.resolve_params(REPO / "presets/seed003.yaml")
    card = int(7.6 * GIB)
    needs = check_report.stage_needs(res.params, res.root, card)
    assert list(needs) == ["sent", "baseline_eval, final_eval", "train"]
    assert needs["sent"] == int(0.85 * card) > needs["train"] > GIB
    assert needs["baseline_eval, final_eval"] == int(0.78 * card) + CUDA_CONTEXT > needs["sent"]
