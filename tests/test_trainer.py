"""The train stage end to end on a tiny random model: 4-bit + LoRA, adapter output, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from grpo.base_model import load_tokenizer
from grpo.collect import generation_calls
from grpo.config import LoraConfig, ModelConfig, ModelConfigError, TrainConfig
from grpo.data import build_prompt
from grpo.jsonio import write_jsonl
from grpo.policy import load_policy
from grpo.rewards import REWARDS
from grpo.rollout import TransformersBackend, completion_mask_from_eos
from grpo.trainer import GRPOTrainer
from grpo.types import Rollout, TrainBatch

from .conftest import REPO

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_completion_mask_from_eos():
    ids = torch.tensor([[5, 6, 9, 7, 9], [9, 1, 1, 1, 1], [1, 2, 3, 4, 5]])
    assert completion_mask_from_eos(ids, {9}).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_policy_is_4bit_lora_and_reference_is_adapter_off(tiny_model_dir):
    import bitsandbytes as bnb

    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    base = model.get_base_model()
    assert isinstance(base.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    assert base.model.layers[0].mlp.up_proj.weight.quant_state.quant_type == "nf4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # a non-zero adapter changes the output; disable_adapter gives the base model back
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    ids = torch.randint(3, 90, (1, 12))
    with torch.no_grad():
        with_adapter = model(input_ids=ids).logits
        with model.disable_adapter():
            reference = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert not torch.allclose(with_adapter, reference)
    torch.testing.assert_close(with_adapter, again)


def test_unknown_lora_target_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ModelConfigError, match="lora.target_modules: .*c_attn"):
        load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(target_modules=["q_proj", "c_attn"]))


def test_trainer_gradients_reach_only_lora_and_follow_the_mask(tiny_model_dir, tiny_problems, tmp_path, monkeypatch):
    # a reward that differs within every group (completion length in characters), so the
    # advantages are non-zero whatever the random tiny model samples
    monkeypatch.setitem(REWARDS, "chars", lambda completions, answers: [float(len(c)) for c in completions])
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    cfg = TrainConfig(
        output_dir=str(tmp_path), steps=2, prompts_per_step=2, group_size=4, max_new_tokens=8,
        checkpoint_every=0, rewards={"chars": 0.1}, mu=2, beta=0.05, micro_batches=2,
    )
    trainer = GRPOTrainer(model, tok, cfg, tiny_problems)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rows = trainer.train(progress=False)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["kept_frac"] <= 0.3
        assert r["completion_len"] > 0 and r["step_time_s"] > 0
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed  # AdamW moved the LoRA weights (lr warm-up starts above zero)


def test_generation_backend_shapes(tiny_model_dir):
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    roll = TransformersBackend(model, tok).generate(["Hi", "What is 1 + 2?"], 3, max_new_tokens=6)
    assert roll.prompt_ids.shape[0] == roll.completion_ids.shape[0] == 6
    assert roll.prompt_mask[0].tolist()[0] == 0  # left padding on the shorter prompt
    assert roll.completion_ids.shape[1] <= 6 and len(roll.texts) == 6
    assert torch.equal(roll.prompt_ids[0], roll.prompt_ids[2])  # completions of a prompt are contiguous


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_forward_equals_full_forward_values_and_lora_grads(tiny_model_dir, checkpointing):
    """Two groups of G = 3 rows, prompts of different lengths (left padding), completions with
    padding: the shared-prompt forward gives the full forward's hidden states and LoRA gradients
    (with gradient checkpointing it falls back to the full forward, so they match trivially)."""
    from grpo.logprobs import completion_hidden
    from grpo.policy import lm_parts

    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), gradient_checkpointing=checkpointing),
                        LoraConfig(**LORA))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)
    model.train()
    body, head = lm_parts(model)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]).repeat_interleave(3, 0)  # (6, 5)
    p_mask = (prompts != 0).long()
    completions = torch.randint(3, 90, (6, 4))
    c_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]] * 2)
    ids, mask = torch.cat([prompts, completions], 1), torch.cat([p_mask, c_mask], 1)
    weights = torch.randn(6, 4, 64)
    results = []
    for g in (1, 3):
        model.zero_grad()
        hidden = completion_hidden(body, ids, mask, 5, group_size=g)  # (6, 4, 64)
        (hidden * weights * c_mask.unsqueeze(-1)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((hidden.detach(), grads))
    (h_full, g_full), (h_shared, g_shared) = results
    torch.testing.assert_close(h_shared * c_mask.unsqueeze(-1), h_full * c_mask.unsqueeze(-1), rtol=1e-4, atol=1e-5)
    for n in g_full:
        torch.testing.assert_close(g_shared[n], g_full[n], rtol=1e-3, atol=1e-4)  # float reassociation


def test_rollout_concat_repads_prompts_left_and_completions_right():
    a = Rollout(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7]]), torch.tensor([[1]]), ["a"],
                torch.tensor([[-0.5]]))
    b = Rollout(torch.tensor([[8]]), torch.tensor([[1]]), torch.tensor([[9, 3]]), torch.tensor([[1, 1]]), ["b"],
                torch.tensor([[-1.0, -2.0]]))
    r = Rollout.concat([a, b], pad_id=0)
    assert r.prompt_ids.tolist() == [[5, 6], [0, 8]] and r.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert r.completion_ids.tolist() == [[7, 0], [9, 3]] and r.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert r.logprobs.tolist() == [[-0.5, 0.0], [-1.0, -2.0]] and r.texts == ["a", "b"]
    assert r.input_ids.tolist() == [[5, 6, 7, 0], [0, 8, 9, 3]]


@pytest.mark.parametrize(("n", "g", "size", "expected"), [
    (3, 4, 0, [(0, 3, 4)]),                                      # one call for the step
    (3, 4, 12, [(0, 3, 4)]),                                     # the step fits
    (5, 2, 4, [(0, 2, 2), (2, 4, 2), (4, 5, 2)]),                # two whole groups per call, one left
    (3, 4, 6, [(0, 1, 4), (1, 2, 4), (2, 3, 4)]),                # one group per call (6 // 4)
    (2, 4, 3, [(0, 1, 3), (0, 1, 1), (1, 2, 3), (1, 2, 1)]),     # a group split 3 + 1
    (1, 5, 2, [(0, 1, 2), (0, 1, 2), (0, 1, 1)]),
])
def test_generation_calls_cover_every_completion_once(n, g, size, expected):
    calls = generation_calls(n, g, size)
    assert calls == expected
    per_prompt = [sum(k for lo, hi, k in calls if lo <= i < hi) for i in range(n)]
    assert per_prompt == [g] * n and all((hi - lo) * k <= (size or n * g) for lo, hi, k in calls)


def test_generation_micro_batches_keep_groups_contiguous_and_fixed_length(tiny_model_dir, tiny_problems, tmp_path):
    """generation_batch_size 3 with 2 prompts x G=4: each group split over calls of 3 and 1 (a call
    never mixes prompts, so each prompt is prefilled once); min_new_tokens = max_new_tokens makes
    every completion full length."""
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    cfg = TrainConfig(output_dir=str(tmp_path), prompts_per_step=2, group_size=4, max_new_tokens=5,
                      generation_batch_size=3, checkpoint_every=0)
    backend = TransformersBackend(model, tok, min_new_tokens=5)
    calls = []
    generate = backend.generate
    backend.generate = lambda prompts, n, **kw: calls.append(len(prompts) * n) or generate(prompts, n, **kw)
    trainer = GRPOTrainer(model, tok, cfg, tiny_problems, backend=backend)
    prompts = ["What is 1 + 2?", "Hi"]
    roll = trainer.rollout(prompts)
    assert calls == [3, 1, 3, 1]
    assert roll.completion_ids.shape == (8, 5) and roll.completion_mask.sum().item() == 40
    real = [tok.decode(ids[m.bool()]) for ids, m in zip(roll.prompt_ids, roll.prompt_mask)]
    assert real == [prompts[0]] * 4 + [prompts[1]] * 4
    row = trainer.train_step()
    assert row["completion_len"] == 5 and row["time_optimizer_s"] > 0


def _write_params(tmp: Path, model_dir: Path, problems: list[dict], **train) -> Path:
    data = tmp / "train.jsonl"
    write_jsonl(data, problems)
    params = {
        "model": {"path": str(model_dir), "quantization": "nf4"},
        "lora": LORA,
        "train": {
            "data_path": str(data),
            "output_dir": str(tmp / "out"),
            "adapter_dir": str(tmp / "adapter"),
            "metrics_dir": str(tmp / "metrics"),
            "steps": 8,
            "prompts_per_step": 2,
            "group_size": 4,
            "max_new_tokens": 12,
            "checkpoint_every": 2,
            "rewards": {"correctness": 1.0, "format_soft": 0.5},
            "wandb_mode": "disabled",
            "rollout_backend": "transformers",  # the decode loop (engine rollouts: tests/test_engine_rollouts.py)
            "eval_every": 0,
            **train,
        },
    }
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def _train(params: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tasks.train", "--params", str(params)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw,
    )


def _steps(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "out" / "steps.jsonl").read_text().splitlines()]


DETERMINISTIC = ("step", "reward_mean", "accuracy", "reward_format_soft_mean", "loss", "entropy_mean", "kept_frac",
                 "completion_len", "grad_norm", "lr")


def test_stage_outputs_and_resume_after_kill_9(tiny_model_dir, tiny_problems, tmp_path):
    """kill -9 after the second checkpoint; the restart continues from it and matches an
    uninterrupted run step for step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    full_dir.mkdir()
    crash_dir.mkdir()
    proc = _train(_write_params(full_dir, tiny_model_dir, tiny_problems))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    uninterrupted = _steps(full_dir)
    assert [r["step"] for r in uninterrupted] == list(range(1, 9))

    # outputs of a complete run: a PEFT adapter that PeftModel loads, and the summary metrics
    adapter = full_dir / "adapter"
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    PeftModel.from_pretrained(base, adapter)
    summary = json.loads((full_dir / "metrics" / "train.json").read_text())
    assert summary["steps"] == 8
    assert (full_dir / "metrics" / "train" / "metrics.json").exists()  # dvclive

    crash_params = _write_params(crash_dir, tiny_model_dir, tiny_problems)
    proc = _train(crash_params)
    second = crash_dir / "out" / "checkpoints" / "step_000004"
    deadline = time.time() + 300
    while not second.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert second.exists(), "second checkpoint never appeared"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (crash_dir / "adapter").exists() and not (crash_dir / "metrics" / "train.json").exists()
    resumed_from = max(int(p.name.split("_")[1]) for p in (crash_dir / "out" / "checkpoints").glob("step_*"))

    proc = _train(crash_params)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "resumed from" in out and f"step {resumed_from})" in out
    resumed = _steps(crash_dir)
    assert [r["step"] for r in resumed] == list(range(1, 9))  # none repeated, none skipped
    for a, b in zip(uninterrupted, resumed):
        assert {k: a[k] for k in DETERMINISTIC} == pytest.approx({k: b[k] for k in DETERMINISTIC}, rel=1e-5, abs=1e-6)


def test_4bit_layers_keep_the_standard_layout_and_repacked_ones_are_refused(tiny_model_dir):
    """bitsandbytes repacks a Linear4bit into its CPU-kernel layout on an eval no-grad forward on
    CPUs with AVX512-BF16, after which dequantize_4bit is wrong: grpo.nf4 switches that off, and
    ``dense_weight`` refuses a repacked layer instead of returning wrong weights."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import has_avx512bf16

    from grpo.nf4 import dense_weight
    from grpo.policy import load_training_base

    model = load_training_base(ModelConfig(path=str(tiny_model_dir)), "cpu")
    layer = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    assert layer.support_avx512bf16_for_cpu is False
    before = dense_weight(layer).clone()  # (out, in)
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, layer.in_features))
    torch.testing.assert_close(dense_weight(layer), before, rtol=0, atol=0)  # still the standard layout
    if not has_avx512bf16():
        pytest.skip("no AVX512-BF16 here: bitsandbytes never repacks on this CPU")
    layer.support_avx512bf16_for_cpu = True  # bitsandbytes' own default on this CPU
    with torch.no_grad():
        layer(torch.randn(2, layer.in_features))
    with pytest.raises(RuntimeError, match="repacked"):
        dense_weight(layer)


def test_dequantized_weights_are_exact_and_temporary(tiny_model_dir):
    import bitsandbytes as bnb

    from grpo.nf4 import dequantized_weights

    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)  # the adapter must still apply inside the block
    ids = torch.randint(3, 90, (2, 10))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with dequantized_weights(model) as patched:
            inside = model(input_ids=ids).logits  # adapter folded into the dense copy
            with model.disable_adapter():
                inside_base = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert not torch.allclose(base, before, atol=1e-3)  # the adapter matters
    torch.testing.assert_close(inside_base, base, rtol=1e-5, atol=1e-5)
    assert patched == sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) > 0
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("quantile", [1.0, 0.2])
def test_updates_raise_the_rewarded_completion(tiny_model_dir, tmp_path, quantile):
    """A group with one rewarded and one unrewarded completion (each twice): a few GRPO updates
    raise the log-likelihood of the rewarded one relative to the other (by 1.7 nats with every
    token kept, 0.3 with the top 20%, when this was written)."""
    from grpo.logprobs import chunked_entropy_logprobs, completion_hidden
    from grpo.loss import group_advantages, loss_normalizer

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    cfg = TrainConfig(output_dir=str(tmp_path), group_size=4, lr=3e-3, warmup_steps=0, entropy_top_quantile=quantile)
    trainer = GRPOTrainer(model, tok, cfg, [{"question": "q", "answer": "7"}])
    prompt = tok(["<|im_start|>user\n3+4?<|im_end|>\n<|im_start|>assistant\n"], add_special_tokens=False)["input_ids"][0]
    good, bad = tok(["#### 7<|im_end|>", "it is 9<|im_end|>"], add_special_tokens=False)["input_ids"]
    width = max(len(good), len(bad))
    pad = tok.pad_token_id
    comps = [good + [pad] * (width - len(good)), bad + [pad] * (width - len(bad))] * 2
    targets = torch.tensor(comps)  # (4, C): good, bad, good, bad
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in (good, bad, good, bad)])
    ids = torch.cat([torch.tensor([prompt] * 4), targets], dim=1)
    attn = torch.cat([torch.ones(4, len(prompt), dtype=torch.long), mask], dim=1)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)

    def seq_logp() -> torch.Tensor:
        with torch.no_grad():
            hidden = completion_hidden(trainer.passes.body, ids, attn, len(prompt))
            return (chunked_entropy_logprobs(hidden, trainer.passes.lm_head, targets)[1] * mask).sum(1)

    start = seq_logp()
    for _ in range(8):
        trainer.passes.loss_backward(TrainBatch(ids, attn, targets, mask, adv, len(prompt)), loss_normalizer(mask, "dapo"))
        trainer.updater.optimizer.step()
        trainer.updater.optimizer.zero_grad()
    end = seq_logp()
    assert end[1] < start[1]  # the unrewarded completion is pushed down
    assert (end[0] - end[1]) - (start[0] - start[1]) > 0.2


def test_stage_logs_to_wandb_offline(tiny_model_dir, tiny_problems, tmp_path):
    params = _write_params(tmp_path, tiny_model_dir, tiny_problems, steps=1, checkpoint_every=0, wandb_mode="offline")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.train", "--params", str(params)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


@pytest.mark.parametrize("mu", [1, 2])
def test_micro_batches_change_memory_not_the_update(tiny_model_dir, tiny_problems, tmp_path, mu):
    """The same rollouts through micro_batches 1 and 4: the same kept tokens (the entropy threshold
    is the step's, not each micro-batch's) and the same accumulated LoRA gradients."""
    from grpo.loss import loss_normalizer

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)  # non-zero adapter: gradients reach A and B
    fields = dict(output_dir=str(tmp_path), prompts_per_step=2, group_size=4, max_new_tokens=10, checkpoint_every=0,
                  entropy_top_quantile=0.2, mu=mu)
    one = GRPOTrainer(model, tok, TrainConfig(**fields, micro_batches=1), tiny_problems)
    four = GRPOTrainer(model, tok, TrainConfig(**fields, micro_batches=4), tiny_problems)
    prompts = [build_prompt(tok, r["question"], "Answer as '#### N'.") for r in tiny_problems[:2]]
    rollout = TransformersBackend(model, tok, min_new_tokens=3).generate(prompts, 4, max_new_tokens=10)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, -0.3, 1.2, -1.2])  # (N,)
    batch = TrainBatch.from_rollout(rollout, advantages, torch.device("cpu"))
    assert len(four.passes.slices(len(batch))) == 4
    normalizer = loss_normalizer(batch.mask, "dapo")
    results = []
    for trainer in (one, four):
        model.train()
        model.zero_grad(set_to_none=True)
        sums, keep = trainer.passes.accumulate_gradients(batch, normalizer)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((sums, keep, grads))
    (s1, keep1, g1), (s4, keep4, g4) = results
    assert torch.equal(keep1, keep4)
    assert 0 < keep1.sum() < batch.mask.sum()  # the mask really selects
    assert s1["kept"] == s4["kept"] and s1["loss"] == pytest.approx(s4["loss"], abs=1e-6)
    for n in g1:
        torch.testing.assert_close(g4[n], g1[n], rtol=0, atol=1e-5)
    assert any(g.abs().max() > 1e-4 for g in g1.values())


def test_logged_stage_is_the_stage_the_rows_came_from(tiny_model_dir, tiny_problems, tmp_path):
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    cfg = TrainConfig(output_dir=str(tmp_path), steps=6, num_stages=3, prompts_per_step=1, group_size=2,
                      max_new_tokens=3, checkpoint_every=0, warmup_steps=0)
    trainer = GRPOTrainer(model, tok, cfg, tiny_problems)
    stage_of_question = {tiny_problems[i]["question"]: s for s, idx in enumerate(trainer.stages) for i in idx}
    rows = trainer.train(progress=False)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == [0, 0, 1, 1, 2, 2]
    for r in rows:
        drawn = {stage_of_question[s["question"]] for s in samples if s["step"] == r["step"]}
        assert drawn == {r["stage"]}, r["step"]
