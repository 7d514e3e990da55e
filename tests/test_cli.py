"""The ``grpo`` command: ``check`` (params, device, DVC status, memory estimate) and ``ask``.

The memory estimate's exact parts are checked against real objects on the tiny Llama and on a
random model of SmolLM2-135M's width (2 of its 30 layers: the per-layer shapes are the real ones):
LoRA parameters against peft's trainable count, NF4 weight bytes against bitsandbytes' storage,
the KV cache against a ``DynamicCache``, saved activations against autograd's saved tensors
(``bench/memory_estimate.py`` runs the same checks on the full 30-layer shape).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from grpo import cli, memory
from grpo.rewards import extract_answer

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from memory_estimate import (  # noqa: E402
    batch,
    real_kv_bytes,
    real_lora_params,
    real_weight_bytes,
    saved_activation_bytes,
)

sys.path.remove(str(REPO / "bench"))


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    """``grpo.cli.main`` sets these (setdefault); set them here so the test session gets them back."""
    for key, value in (("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("TQDM_DISABLE", "1")):
        monkeypatch.setenv(key, value)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------- check
@pytest.mark.parametrize("params", ["params.yaml", "presets/seed003.yaml", "presets/seed001.yaml"])
def test_check_prints_settings_device_dvc_and_the_estimate(params, capsys):
    code, out, err = run(capsys, "check", "--params", str(REPO / params), "--prompt-tokens", "100")
    assert code == 0, err
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
    code, out, _ = run(capsys, "check", "--params", str(REPO / "presets/seed003.yaml"), "--device", "cuda",
                       "--prompt-tokens", "128")
    assert code == 0
    assert "on cuda (bfloat16 compute)" in out and "dense 4-bit copies" not in out
    assert "seed 003's step" in out and "not measured yet" in out


def test_measured_figures_name_real_params_and_a_bad_file_is_one_line(tmp_path):
    """measured.yaml (the one home of the figures ``grpo check`` prints) names params fields that
    exist; an entry missing a key fails with one line naming the file."""
    from grpo.config import Params

    entries = memory.load_measured()
    assert {m["device"] for m in entries} == {"cpu", "cuda"}
    for m in entries:
        for key in m["params"]:
            section, name = key.split(".")
            assert name in type(getattr(Params(), section)).model_fields, key
    bad = tmp_path / "measured.yaml"
    bad.write_text(yaml.safe_dump([{"what": "x", "device": "cpu"}]))
    with pytest.raises(ValueError, match=r"measured.yaml: entry 0: missing command, date, commit, shape, params, figure"):
        memory.load_measured(bad)


def test_unknown_key_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"train": {"learning_rate": 0.1}}))
    proc = subprocess.run([sys.executable, "-m", "grpo.cli", "check", "--params", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith(f"grpo check: error: {path}: train.learning_rate: unknown key; known keys: ")


def test_a_preset_is_put_over_the_workspace_params(tmp_path):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": {"steps": 7, "lr": 1.0e-3}}))
    (tmp_path / "presets").mkdir()
    preset = tmp_path / "presets" / "p.yaml"
    preset.write_text(yaml.safe_dump({"train": {"lr": 2.0e-4}}))
    res = cli.resolve_params(preset)
    assert res.root == tmp_path
    assert (res.params.train.steps, res.params.train.lr) == (7, 2.0e-4)
    assert res.changed == ["train.lr"]
    assert cli.resolve_params(tmp_path / "params.yaml").changed == []
    from grpo.dvcstatus import describe

    assert describe(tmp_path) == [f"dvc: {tmp_path} is not a DVC workspace (it needs a .dvc folder and a dvc.yaml): "
                                  "no stage status"]


def test_estimate_without_a_config_says_so(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "someone/unknown-model", "path": str(tmp_path / "none")}}))
    code, out, _ = run(capsys, "check", "--params", str(path))
    assert code == 0
    assert "memory: no estimate: the estimate needs the model's config.json" in out


# ------------------------------------------------------------------------------------- exact parts
@pytest.fixture(scope="module")
def smol_width_dir(tmp_path_factory):
    """A random model of SmolLM2-135M's exact width (hidden 576, 9/3 heads, intermediate 1536,
    vocab 49,152, tied), 2 layers."""
    from grpo.synthetic import architecture_config, random_model_dir

    cfg = architecture_config("smollm2-135m")
    cfg.num_hidden_layers = 2
    return random_model_dir(tmp_path_factory.mktemp("smol-width"), cfg)


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_lora_nf4_and_kv_cache_terms_equal_the_real_objects(which, tiny_model_dir, smol_width_dir):
    from transformers import AutoConfig

    from grpo.config import LoraConfig, ModelConfig
    from grpo.policy import attach_lora, load_training_base

    path = tiny_model_dir if which == "tiny" else smol_width_dir
    shapes = memory.model_shapes(AutoConfig.from_pretrained(path))
    base = load_training_base(ModelConfig(path=str(path)), "cpu")
    # NF4 weights + the rest in fp32: to the byte (the brief allows 10%)
    assert memory.weight_bytes(shapes, "nf4", 4) == real_weight_bytes(base)
    # KV cache of a short fixed-length generation: 4 rows, 12 prompt tokens (3 padded) + 5 generated - 1
    ids, mask = batch(shapes.vocab, 2, 2, 12, 0)
    assert memory.kv_cache_bytes(shapes, 4, 12 + 5 - 1, 4) == real_kv_bytes(base, ids, mask, 5)
    lora = LoraConfig(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = attach_lora(base, lora, gradient_checkpointing=False)
    assert memory.lora_params(shapes, lora.rank, lora.target_modules) == real_lora_params(model)


@pytest.mark.parametrize("dtype,dropout,checkpointing,shared", [
    ("float32", 0.0, False, True), ("float32", 0.0, False, False), ("float32", 0.0, True, False),
    ("bfloat16", 0.05, False, True),
])
def test_activation_term_matches_autograds_saved_tensors(dtype, dropout, checkpointing, shared, tiny_model_dir):
    from transformers import AutoConfig

    from grpo.config import LoraConfig, ModelConfig
    from grpo.policy import load_policy

    torch.manual_seed(0)
    shapes = memory.model_shapes(AutoConfig.from_pretrained(tiny_model_dir))
    lora = LoraConfig(dropout=dropout)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype=dtype, gradient_checkpointing=checkpointing),
                        lora, "cpu")
    prompts, group, p, c = 2, 4, 16, 24
    ids, mask = batch(shapes.vocab, prompts, group, p, c)
    est, _ = memory.activation_bytes(
        shapes, rows=prompts * group, prompt=p, completion=c, group=group, b=torch.finfo(getattr(torch, dtype)).bits // 8,
        lora_rank=lora.rank, targets=lora.target_modules, dropout=dropout, checkpointing=checkpointing,
        shared=shared and not checkpointing, device="cpu")
    real = saved_activation_bytes(model, ids, mask, p, group if shared else 1)
    assert est == pytest.approx(real, rel=0.03)


def test_shapes_from_a_hub_name_and_the_lora_count_of_seed003():
    from grpo.config import ModelConfig

    shapes = memory.resolve_shapes(ModelConfig(name="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                                               path="models/none"), REPO)
    assert shapes.hidden == 1536 and shapes.layers == 28 and shapes.vocab == 151936
    assert memory.lora_params(shapes, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 4_358_144  # README: ~4.4 M


# ------------------------------------------------------------------------------------- ask
@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter on the tiny model with non-zero B (an untrained adapter changes nothing)."""
    from grpo.config import LoraConfig, ModelConfig
    from grpo.policy import load_policy

    torch.manual_seed(1)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(), "cpu")
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_params(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("params") / "params.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(tiny_model_dir)}}))
    return path


def _reference(tiny_model_dir, adapter, tmp_path, max_new_tokens):
    """Greedy completion by the evaluation's own path: dense export + the transformers backend."""
    from grpo.base_model import load_tokenizer
    from grpo.config import ModelConfig, Params
    from grpo.data import build_prompt
    from grpo.policy import export_dense, load_base_model
    from grpo.rollout import TransformersBackend

    export = export_dense(ModelConfig(path=str(tiny_model_dir)), adapter, tmp_path / "ref")
    tok = load_tokenizer(export["path"])
    backend = TransformersBackend(load_base_model(export["path"]), tok)
    prompt = build_prompt(tok, QUESTION, Params().train.system_prompt)
    return backend.generate([prompt], 1, max_new_tokens=max_new_tokens, temperature=0.0).texts[0]


QUESTION = "What is 3 + 4?"


@pytest.mark.parametrize("with_adapter", [False, True])
def test_ask_streams_the_greedy_completion_and_its_answer(with_adapter, tiny_model_dir, adapter_dir, tiny_params,
                                                          tmp_path, capsys):
    argv = ["ask", QUESTION, "--params", str(tiny_params), "--max-new-tokens", "24"]
    if with_adapter:
        argv += ["--adapter", str(adapter_dir)]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert out.endswith("\n")
    text, answer_line, _ = out.rsplit("\n", 2)  # the streamed text, a line break, the answer line
    expected = _reference(tiny_model_dir, adapter_dir if with_adapter else None, tmp_path, 24)
    assert text == expected and text
    found = extract_answer(expected)
    assert answer_line == f"answer: {found if found is not None else '(none)'}"
    assert ("LoRA merged" in err) == with_adapter
    if with_adapter:  # the adapter changes the output
        assert expected != _reference(tiny_model_dir, None, tmp_path, 24)


def test_ask_names_a_missing_model_or_adapter(tmp_path, tiny_params, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "no-model")}}))
    code, out, err = run(capsys, "ask", "1 + 1?", "--params", str(path))
    assert code == 2 and out == ""
    assert err.splitlines() == [f"grpo ask: error: model.path: {tmp_path / 'no-model'}: no model there (no "
                                "config.json; run `dvc repro prepare_model` first)"]
    code, out, err = run(capsys, "ask", "1 + 1?", "--params", str(tiny_params), "--adapter", str(tmp_path / "none"))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"grpo ask: error: --adapter: {tmp_path / 'none'}: ")
