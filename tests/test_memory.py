"""The memory estimate's exact parts (``grpo.tools.memory``), checked against real objects on the tiny Llama and
on a random model of SmolLM2-135M's width (2 of its 30 layers: the per-layer shapes are the real ones):
LoRA parameters against peft's trainable count, NF4 weight bytes against bitsandbytes' storage,
the KV cache against a ``DynamicCache``, saved activations against autograd's saved tensors
(``tests/real_memory.py``: the real objects).
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from grpo.rollout.engine import needs
from grpo.tools import memory
from grpo.training.trainer_builder import depart

from .conftest import REPO
from .real_memory import batch, real_kv_bytes, real_lora_params, real_weight_bytes, saved_activation_bytes


@pytest.fixture(scope="module")
def smol_width_dir(tmp_path_factory):
    """A random model of SmolLM2-135M's exact width (hidden 576, 9/3 heads, intermediate 1536,
    vocab 49,152, tied), 2 layers."""
    from grpo.tools.synthetic import architecture_config, random_model_dir

    cfg = architecture_config("smollm2-135m")
    cfg.num_hidden_layers = 2
    return random_model_dir(tmp_path_factory.mktemp("smol-width"), cfg)


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_lora_nf4_and_kv_cache_terms_equal_the_real_objects(which, tiny_model_dir, smol_width_dir):
    from transformers import AutoConfig

    from grpo.config.sections.lora import LoraConfig
    from grpo.config.sections.model import ModelConfig
    from grpo.model.lora_policy import attach_lora, load_training_base

    path = tiny_model_dir if which == "tiny" else smol_width_dir
    shapes = memory.model_shapes(AutoConfig.from_pretrained(path))
    base = load_training_base(ModelConfig(path=str(path), dtype="float32"), "cpu")
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

    from grpo.config.sections.lora import LoraConfig
    from grpo.config.sections.model import ModelConfig
    from grpo.model.lora_policy import load_policy

    torch.manual_seed(0)
    shapes = memory.model_shapes(AutoConfig.from_pretrained(tiny_model_dir))
    lora = LoraConfig(dropout=dropout)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype=dtype, gradient_checkpointing=checkpointing),
                        lora, "cpu")
    prompts, group, p, c = 2, 4, 16, 24
    ids, mask = batch(shapes.vocab, prompts, group, p, c)
    call = memory.ForwardShape(prompts * group, p, c, group, shared=shared and not checkpointing)
    est, _ = memory.activation_bytes(shapes, lora, call, b=torch.finfo(getattr(torch, dtype)).bits // 8,
                                     checkpointing=checkpointing, device="cpu")
    real = saved_activation_bytes(model, ids, mask, p, group if shared else 1)
    assert est == pytest.approx(real, rel=0.03)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_activation_term_matches_autograds_saved_tensors(checkpointing, tiny_model_dir):
    """Each group packed into one sequence (``train.passes.forward_layout: packed``), every completion at
    full length (the estimate's worst case): one pass over N / G sequences of P + G (C - 1) tokens."""
    from transformers import AutoConfig

    from grpo.config.sections.lora import LoraConfig
    from grpo.config.sections.model import ModelConfig
    from grpo.model.lora_policy import load_policy

    torch.manual_seed(0)
    shapes = memory.model_shapes(AutoConfig.from_pretrained(tiny_model_dir))
    lora = LoraConfig()
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32", gradient_checkpointing=checkpointing),
                        lora, "cpu")
    prompts, group, p, c = 2, 4, 16, 5
    ids, mask = batch(shapes.vocab, prompts, group, p, c)  # completions of 5: none shortened
    est, _ = memory.activation_bytes(shapes, lora, memory.ForwardShape(prompts, p + group * (c - 1), 0, group),
                                     b=4, checkpointing=checkpointing, device="cpu")
    real = saved_activation_bytes(model, ids, mask, p, group, packed=True)
    assert est == pytest.approx(real, rel=0.03)


def test_shapes_from_a_hub_name_and_the_lora_count_of_seed003():
    from grpo.config.sections.model import ModelConfig

    shapes = memory.resolve_shapes(ModelConfig(name="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                                               path="models/none"), REPO)
    assert shapes.hidden == 1536 and shapes.layers == 28 and shapes.vocab == 151936
    assert memory.lora_params(shapes, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 4_358_144  # README: ~4.4 M


def test_measured_figures_name_real_params_and_a_bad_file_is_one_line(tmp_path):
    """measured.yaml (the one home of the figures ``grpo check`` prints) names params fields that
    exist; an entry missing a key fails with one line naming the file."""
    from grpo.config.params import AllParams

    entries = memory.load_measured()
    assert {m["device"] for m in entries} == {"cpu", "cuda"}
    for m in entries:
        for key in m["params"]:
            memory._get(AllParams(), key)  # a key of today's params (an AttributeError or KeyError otherwise)
    bad = tmp_path / "measured.yaml"
    bad.write_text(yaml.safe_dump([{"what": "x", "device": "cpu"}]))
    with pytest.raises(ValueError, match=r"measured.yaml: entry 0: missing command, date, commit, shape, params, figure"):
        memory.load_measured(bad)


def _preset(name: str):
    from grpo.tools.cli import resolve_params

    return resolve_params(REPO / "presets" / f"{name}.yaml").params


def test_a_measured_figure_of_another_token_rule_is_named_as_the_nearest_shape():
    """The measured entries of seed 003's step ran ``high``: a params file that chooses another rule
    reads them as the nearest measured shape, the rule named, with the estimate under ``high`` beside
    them (each rule's LM head differs: 1/q rows with grad for the rules that drop no token)."""
    preset = _preset("seed003")
    # the shape those runs had: 8 micro-batches (the preset runs 2 since bench/step_model.py counted its launches)
    params = depart(preset, {"train.loss.entropy_rule": "high", "train.passes.micro_batches": 8,
                             "train.loss.entropy_rule_options.high.top_quantile": 0.2})  # high's quantile then
    shapes = memory.resolve_shapes(params.model, REPO)
    same = [line for line in memory.measured_for(params, shapes, "cuda", 128) if "H100, " in line]
    assert same and all(", this shape: " in line for line in same), same
    archer = depart(params, {"train.loss.entropy_rule": "archer"})
    other = [line for line in memory.measured_for(archer, shapes, "cuda", 128) if "H100, " in line]
    assert len(other) == len(same)
    assert all("entropy_rule=high (here archer)" in line and "this estimate at that shape: " in line
               for line in other), other


def test_the_verdict_flips_when_the_card_shrinks_and_names_the_knob():
    params = _preset("seed003")
    shapes = memory.resolve_shapes(params.model, REPO)

    def verdict(gib: float, p=params) -> str:
        card = int(gib * 2**30)
        plan = needs.engine_plan(p, shapes, "cuda", 128, card)
        est = memory.estimate(p, shapes, "cuda", 128, engine=plan)
        return memory.verdict(p, est, card, plan, needs.other_plans(p, shapes, "cuda", 128, plan))

    assert " fits: peak 3.22 GiB (training)" in verdict(8)  # the update's 2 micro-batches of 8 rows
    # 0.12 x 4.1 GiB = 0.49 GiB < the nf4 engine's 0.70: more of the card, which has room for it (up to
    # what the policy and the measured CUDA context leave free)
    assert "budget 503.8 MiB < its needs 714.6 MiB (nf4); turn train.rollouts.gpu_memory_utilization: between 0.18 " \
           "and 0.43" in verdict(4.1)
    # 2.5 GiB: the engine's weights and overhead alone do not fit beside the policy
    assert verdict(2.5).endswith("turn train.rollouts.backend: transformers (the decode loop: no engine)")
    # a dense engine at 0.75 of 5.5 GiB is not free beside the policy, nor would its needs be; the nf4 one's are
    dense = depart(params, {"train.rollouts.engine_weights": "dense", "train.rollouts.gpu_memory_utilization": 0.75})
    assert "is not free at its start" in verdict(5.5, dense)
    assert verdict(5.5, dense).endswith("turn train.rollouts.engine_weights: nf4 (needs 714.6 MiB)")


def test_saved_model_engines_of_the_tiny_model_by_hand(tiny_model_dir):
    """SENT's and the evaluation's engines: dense weights in the engine dtype, the profile run at
    vLLM's default max_num_batched_tokens for a call of ``max_num_seqs`` = the call's sequences,
    the KV cache of that call; the budget is the section's share of the card."""
    from transformers import AutoConfig

    from grpo.config.params import AllParams

    shapes = memory.model_shapes(AutoConfig.from_pretrained(tiny_model_dir))
    params = AllParams.model_validate({
        "sent": {"batch_prompts": 3, "num_samples": 4, "max_new_tokens": 7, "max_model_len": 256, "dtype": "float32",
                 "gpu_memory_utilization": 0.25},
        "evaluate": {"batch_prompts": 5, "max_new_tokens": 9, "max_model_len": 128, "gpu_memory_utilization": 0.5}})
    card = 2**30
    sent = memory.saved_model_needs(params, shapes, "cuda", "sent", 20, card)
    assert (sent.section, sent.form, sent.b, sent.seqs) == ("sent", "dense", 4, 12)  # 3 prompts x 4 samples, fp32
    assert sent.batched_tokens == min(8192, 12 * 256)  # vLLM's default on a card below 70 GiB, capped
    assert sent.weights == shapes.total_params * 4 and sent.lora == 0
    assert (sent.forward, sent.sampler) == needs.engine_profile_bytes(shapes, 12 * 256, 12, 4)
    assert sent.step_tokens == max(12 * 32, 256)  # 20 + 7 tokens in 2 blocks of 16 each; one 256 sequence at least
    assert sent.need == sent.weights + max(sent.forward, sent.sampler) + needs.ENGINE_NON_TORCH + sent.kv_step
    assert sent.budget == math.ceil(0.25 * card)
    ev = memory.saved_model_needs(params, shapes, "cuda", "evaluate", 20, card)
    assert (ev.seqs, ev.b, ev.batched_tokens, ev.budget) == (5, 2, 5 * 128, card // 2)  # 5 x 1 greedy, bf16
    assert ev.step_tokens == max(5 * 32, 128)
    assert memory.default_batched_tokens("cpu", None, 256, 1024) == 4096
    assert memory.default_batched_tokens("cuda", None, 256, 1024) == 8192
    assert memory.default_batched_tokens("cuda", 80 * 2**30, 256, 1024) == 16384


def test_the_saved_model_verdicts_of_seed003_name_the_knob():
    """Seed 003 on a card that reports 7.6 GiB (dense 1.5B in bf16: 3.31 GiB): the preset's SENT (16
    prompts x 8) and evaluation engines fit (at 0.85 and 0.78 of the card: the evaluation
    process holds two CUDA contexts); at the earlier 0.6 share SENT's 256
    sequences of 640 tokens have no KV room and the evaluation's 64 do not fit; on 24 GiB both fit."""
    shipped = _preset("seed003")
    shapes = memory.resolve_shapes(shipped.model, REPO)
    earlier = shipped.model_copy(update={
        "sent": shipped.sent.model_copy(update={"batch_prompts": 64, "gpu_memory_utilization": 0.6}),
        "evaluate": shipped.evaluate.model_copy(update={"gpu_memory_utilization": 0.6})})

    def verdict(section: str, gib: float, params=earlier) -> str:
        plan = memory.saved_model_needs(params, shapes, "cuda", section, 128, int(gib * 2**30))
        return memory.saved_model_verdict(params, shapes, "cuda", plan, 128)

    assert verdict("sent", 7.6, shipped).startswith("card 7.60 GiB: fits: ")
    assert verdict("evaluate", 7.6, shipped).startswith("card 7.60 GiB: fits: ")
    sent = verdict("sent", 7.6)
    assert sent.startswith("card 7.60 GiB: does not fit: ") and "256 sequences x 640 tokens" in sent
    assert "(the engine does not start); turn sent.batch_prompts: at most " in sent
    evaluation = verdict("evaluate", 7.6)
    assert "64 sequences x 640 tokens" in evaluation and "(vLLM keeps fewer in flight)" in evaluation
    assert evaluation.endswith("turn evaluate.gpu_memory_utilization: between 0.68 and 0.80")
    assert verdict("sent", 24).startswith("card 24.00 GiB: fits: ")
    assert verdict("evaluate", 24).startswith("card 24.00 GiB: fits: ")
    assert "is not free at its start" in verdict("evaluate", 2) and verdict("evaluate", 2).endswith(
        "turn evaluate.backend: transformers (the decode loop: no engine)")


def test_on_cuda_the_decode_loops_dense_copies_are_a_term_and_left_out_where_they_do_not_fit():
    """Seed 003 with the decode loop on CUDA: the dense copies count in the generation phase, and in
    the update's too where the decode step is compiled (it keeps them: ``decode.compile_step: auto``
    on CUDA at seed 003's 500 x 512 token steps); on a card where only the 4-bit decode fits, the
    verdict says so (and which term it left out); on a card too small for either, it names the knob."""
    params = _preset("seed003")
    params = depart(params, {"train.rollouts.backend": "transformers"})
    shapes = memory.resolve_shapes(params.model, REPO)
    uncompiled = params.model_copy(update={"decode": params.decode.model_copy(update={"compile_step": "off"})})
    assert next(t for t in memory.estimate(uncompiled, shapes, "cuda", 128).terms
                if t.name == memory.DENSE_COPIES).phase == "generate"
    est = memory.estimate(params, shapes, "cuda", 128)
    dense = next(t for t in est.terms if t.name == memory.DENSE_COPIES)
    assert dense.phase == "both" and dense.bytes == (shapes.quantized_params + sum(
        x.params for x in memory.lora_targets(shapes, params.lora.target_modules) if x.quantized)) * 2
    lean_peak = max(est.total("generate"), est.total("train")) - dense.bytes
    gib = 2**30

    def verdict(card: int) -> str:
        return memory.verdict(params, est, card)

    roomy = est.peak + memory.CUDA_CONTEXT + gib
    assert " fits: peak " in verdict(roomy) and "4-bit decoding" not in verdict(roomy)
    tight = lean_peak + memory.CUDA_CONTEXT + 1
    assert tight < est.peak + memory.CUDA_CONTEXT  # the dense copies make the difference
    assert " fits with 4-bit decoding: " in verdict(tight) and memory.gib(dense.bytes) in verdict(tight)
    assert " does not fit: " in verdict(lean_peak // 2)


def test_the_compiled_decode_step_is_kept_and_the_saved_model_calls_fit_seed003s_card():
    """Seed 003 with the decode loop on CUDA (the step compiled): the step's buffers (its cache for
    the call padded to its shape, mask, graph pool) count in both phases instead of the KV cache;
    on a CPU the terms are the dynamic loop's. SENT's and the evaluation's calls
    (``decode_call``) are split to fit the 7.6 GiB card beside the CUDA context, onto a step of a
    power of two of prompts, and not split where the card is unknown."""
    from grpo.rollout.decode_memory import compiled_step_bytes, shapes_dims

    params = depart(_preset("seed003"), {"train.rollouts.backend": "transformers"})
    shapes = memory.resolve_shapes(params.model, REPO)
    est = memory.estimate(params, shapes, "cuda", 128)
    step = next(t for t in est.terms if t.name == memory.COMPILED_STEP)
    rows = params.train.rollouts.prompts_per_step * params.train.rollouts.group_size
    assert step.phase == "both" and step.bytes == compiled_step_bytes(shapes_dims(shapes, 2), rows, 128 + 512)
    assert not any(t.name == "KV cache" for t in est.terms)
    cpu = memory.estimate(params, shapes, "cpu", 128)
    assert any(t.name == "KV cache" for t in cpu.terms) and not any(t.name == memory.COMPILED_STEP for t in cpu.terms)
    card = int(7.6 * 2**30)
    for section in ("sent", "evaluate"):
        cfg = getattr(params, section)
        call = memory.decode_call(params, shapes, "cuda", section, 128, card)
        assert call.need + memory.CUDA_CONTEXT <= card and 1 <= call.per_call < cfg.batch_prompts, section
        assert call.compiled.prompts >= call.per_call and call.compiled.prompts & (call.compiled.prompts - 1) == 0
        assert "; fits" in memory.decode_call_verdict(call, card)
        assert memory.decode_call(params, shapes, "cuda", section, 128, None).per_call == cfg.batch_prompts
