"""``grpo ask``: the question's greedy completion streamed by the evaluation's own path, with or without
an adapter, and one line naming a missing model or adapter."""

from __future__ import annotations

import pytest
import torch
import yaml

from grpo.algorithm.rewards import extract_answer

from .helpers import give_adapter_a_say, run

pytestmark = pytest.mark.usefixtures("quiet_cli_env")


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter on the tiny model with non-zero B (an untrained adapter changes nothing)."""
    from grpo.config.sections.lora import LoraConfig
    from grpo.config.sections.model import ModelConfig
    from grpo.model.lora_policy import load_policy

    torch.manual_seed(1)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(), "cpu")
    give_adapter_a_say(model, std=0.5)
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
    from grpo.config.params import AllParams
    from grpo.config.sections.model import ModelConfig
    from grpo.data.sources import build_prompt
    from grpo.model.base_model import load_tokenizer
    from grpo.model.lora_policy import export_dense, load_base_model
    from grpo.rollout.rollout_backends import TransformersBackend

    export = export_dense(ModelConfig(path=str(tiny_model_dir)), adapter, tmp_path / "ref")
    tok = load_tokenizer(export["path"])
    backend = TransformersBackend(load_base_model(export["path"]), tok)
    prompt = build_prompt(tok, QUESTION, AllParams().train.system_prompt)
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
                                "such folder); run `dvc repro prepare_model` first"]
    code, out, err = run(capsys, "ask", "1 + 1?", "--params", str(tiny_params), "--adapter", str(tmp_path / "none"))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"grpo ask: error: --adapter: {tmp_path / 'none'}: ")


@pytest.mark.parametrize("files", [[], ["config.json"]], ids=["empty", "no-weights"])
def test_ask_names_an_empty_model_folder(tmp_path, capsys, files):
    """A model folder that is empty, or has a config but no weights: one line naming the folder and
    what it lacks."""
    model = tmp_path / "base"
    model.mkdir()
    for name in files:
        (model / name).write_text("{}")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(model)}}))
    code, out, err = run(capsys, "ask", "1 + 1?", "--params", str(path))
    lacks = "no weights: no *.safetensors or pytorch_model*.bin" if files else "no config.json"
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"grpo ask: error: model.path: {model}: no model there ({lacks}); run `dvc repro "
                                "prepare_model` first"]


@pytest.mark.parametrize("question", ["", "  \n "])
def test_ask_refuses_an_empty_question_before_loading_anything(question, monkeypatch, capsys):
    """An empty or blank question is one line and exit 2; neither the params nor the model is read."""
    from grpo.tools import cli

    monkeypatch.setattr(cli, "resolve_params", lambda *a: pytest.fail("params read for an empty question"))
    code, out, err = run(capsys, "ask", question, "--params", "/nonexistent/params.yaml")
    assert (code, out) == (2, "")
    assert err.splitlines() == ['grpo ask: error: the question is empty; ask one, e.g. grpo ask "What is 2 + 3?"']


def _saved_adapter(model_dir, out, **lora):
    from grpo.config.sections.lora import LoraConfig
    from grpo.config.sections.model import ModelConfig
    from grpo.model.lora_policy import load_policy

    load_policy(ModelConfig(path=str(model_dir)), LoraConfig(**lora), "cpu").save_pretrained(out)
    return out


def _ask_cli(params, adapter):
    """The real ``grpo`` command, in a process of its own."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "grpo.tools.cli", "ask", "1 + 1?", "--params", str(params), "--adapter",
                           str(adapter)], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_an_adapter_that_does_not_fit_the_base_is_one_line_naming_both(adapter_dir, tiny_model_dir, tiny_params,
                                                                        tmp_path):
    """A rank-8 adapter's weights under a rank-r config (two adapters mixed in one folder), and a
    real adapter of a base of another width: each refused before loading, in one line naming the
    adapter and the base; the adapter's files are left as they were."""
    import json
    import shutil

    from grpo.config.sections.lora import LoraConfig

    from .conftest import build_tiny_model_dir

    mixed = _saved_adapter(tiny_model_dir, tmp_path / "mixed", rank=8)
    shutil.copy(adapter_dir / "adapter_config.json", mixed / "adapter_config.json")
    before = {p.name: p.read_bytes() for p in mixed.iterdir()}
    rank = LoraConfig().rank
    targets = ", ".join(sorted(json.loads((adapter_dir / "adapter_config.json").read_text())["target_modules"]))
    proc = _ask_cli(tiny_params, mixed)
    assert (proc.returncode, proc.stdout) == (2, "")
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"grpo ask: error: {mixed} (rank {rank} on {targets}, trained on {tiny_model_dir}): its "
                           "weights have rank 8 (base_model.model.model.layers.")
    assert line.endswith(f"its adapter_config.json says {rank}: the files come from two adapters; train it again")
    assert {p.name: p.read_bytes() for p in mixed.iterdir()} == before

    narrow = build_tiny_model_dir(tmp_path / "narrow", hidden=32)
    other = _saved_adapter(narrow, tmp_path / "other")
    proc = _ask_cli(tiny_params, other)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [
        f"grpo ask: error: {other} (rank {rank} on {targets}, trained on {narrow}) does not fit the base "
        f"{tiny_model_dir}: model.layers.0.self_attn.{targets.split(', ')[0]} has 64 input features there, 32 in the "
        "adapter"]
