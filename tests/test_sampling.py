"""``grpo.rollout.sampling``: the sampler's distribution, and the decode loop against ``model.generate``."""

from __future__ import annotations

import pytest
import torch

from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.rollout.sampling import DECODE_LOOPS, Draw, DynamicLoop, StaticLoop, decode, sample_tokens

from .helpers import give_adapter_a_say


def test_sample_tokens_follows_the_softmax():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).expand(20000, 4)  # p = .5 .3 .2 0
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample_tokens(logits, 1.0, generator=gen), minlength=4).float() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.015, rtol=0)


def test_temperature_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(20000, 3)
    gen = torch.Generator().manual_seed(1)
    # temperature 0.5 squares the probabilities: .25 .09 .04 -> / .38
    hot = torch.bincount(sample_tokens(logits, 0.5, generator=gen), minlength=3).float() / 20000
    torch.testing.assert_close(hot, torch.tensor([0.25, 0.09, 0.04]) / 0.38, atol=0.015, rtol=0)
    # top_p 0.7: the nucleus is {0.5, 0.3} (0.5 alone < 0.7), renormalised to 5/8, 3/8
    nucleus = torch.bincount(sample_tokens(logits, 1.0, top_p=0.7, generator=gen), minlength=3).float() / 20000
    torch.testing.assert_close(nucleus, torch.tensor([0.625, 0.375, 0.0]), atol=0.015, rtol=0)
    # top_p below the largest probability keeps exactly one token; temperature 0 is argmax
    assert sample_tokens(logits[:50], 1.0, top_p=0.1, generator=gen).eq(0).all()
    assert sample_tokens(torch.tensor([[0.1, 2.0, -1.0]]), 0.0).item() == 1


def _policy(tiny_model_dir):
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), gradient_checkpointing=False),
                        LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    give_adapter_a_say(model, std=0.3)
    return model.eval(), load_tokenizer(tiny_model_dir)


def test_greedy_decode_equals_generate_with_padding_and_eos(tiny_model_dir):
    """Left-padded prompts of different lengths, 2 samples each, and an "EOS" chosen among the
    tokens greedy decoding emits, so rows finish at different steps and leave the batch: the
    tokens must still be exactly those of ``model.generate``."""
    model, tok = _policy(tiny_model_dir)
    tok.padding_side = "left"
    enc = tok(["What is 1 + 2?", "Hi", "7 * 8 = ?"], return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    free = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None,
                          pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    eos = int(free[0, 3])  # row 0 ends at step 4 at the latest; the others when (if) they emit it
    ours = decode(model, enc["input_ids"], enc["attention_mask"], 2, Draw(12, {eos}, tok.pad_token_id, temperature=0),
                  DynamicLoop())
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    assert ours.shape == ref.shape and torch.equal(ours, ref)
    assert (ours == tok.pad_token_id).any()  # some row did finish early


def test_finished_rows_leave_the_batch_and_min_new_tokens_holds(tiny_model_dir):
    model, tok = _policy(tiny_model_dir)
    enc = tok(["What is 1 + 2?"], return_tensors="pt", add_special_tokens=False)
    stop = set(range(3, 60))  # most ids end a row, so rows finish early and at different steps
    calls = []
    forward = model.forward
    model.forward = lambda *a, **kw: calls.append(kw["input_ids"].shape[0]) or forward(*a, **kw)
    try:
        torch.manual_seed(0)
        out = decode(model, enc["input_ids"], enc["attention_mask"], 8, Draw(30, stop, tok.pad_token_id, temperature=5.0),
                     DynamicLoop())
        torch.manual_seed(0)
        fixed = decode(model, enc["input_ids"], enc["attention_mask"], 4,
                       Draw(6, stop, tok.pad_token_id, temperature=5.0, min_new_tokens=6), DynamicLoop())
    finally:
        del model.forward
    assert out.shape[0] == 8 and all(torch.isin(row, torch.tensor(sorted(stop))).any() for row in out)
    first = calls[: 1 + out.shape[1] - 1]
    assert first[0] == 1  # the prompt is prefilled once for its 8 samples
    assert first[1:] == sorted(first[1:], reverse=True) and first[-1] < 8  # the batch shrinks
    assert fixed.shape == (4, 6) and not torch.isin(fixed, torch.tensor(sorted(stop))).any()


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_static_loop_gives_the_dynamic_loops_tokens(tiny_model_dir):
    """The static loop (fixed shapes, EOS checked every few tokens) against the dynamic one, same
    row seeds: left-padded prompts of three lengths, rows finishing at different steps, sampled at
    temperature 1.5 with top-p and at temperature 0, with and without ``min_new_tokens``; the
    tokens must be equal, trailing pads and the returned length included."""
    model, tok = _policy(tiny_model_dir)
    tok.padding_side = "left"
    enc = tok(["What is 1 + 2?", "Hi", "7 * 8 = ?"], return_tensors="pt", padding=True, add_special_tokens=False)
    stop = set(range(3, 40))
    seeds = list(range(100, 112))
    finished_early = False
    for temperature, top_p, min_new in [(1.5, 0.9, 0), (1.5, 1.0, 5), (0.0, 1.0, 0)]:
        draw = Draw(20, stop, tok.pad_token_id, temperature, top_p, min_new, seeds)
        dynamic = decode(model, enc["input_ids"], enc["attention_mask"], 4, draw, DynamicLoop())
        for check_every in (1, 3, 16):
            static = decode(model, enc["input_ids"], enc["attention_mask"], 4, draw,
                            StaticLoop(StaticLoop.Options(check_every=check_every)))
            assert static.shape == dynamic.shape and torch.equal(static, dynamic), (temperature, check_every)
        finished_early |= bool((dynamic == tok.pad_token_id).any())
    assert finished_early  # some row did leave the dynamic batch


def test_auto_loop_is_dynamic_on_the_cpu_and_a_bad_name_is_one_line():
    from grpo.rollout.sampling import resolve_loop

    assert resolve_loop("auto", "cpu") == "dynamic" and resolve_loop("auto", "cuda") == "static"
    assert resolve_loop("static", "cpu") == "static"
    names = ", ".join(DECODE_LOOPS.accepted())  # every registered loop: a new one needs no edit here
    with pytest.raises(ValueError, match=f"^loop: must be one of {names}; got 'fast'$"):
        resolve_loop("fast", "cpu")


def _dense_fp32(tiny_model_dir):
    from grpo.model.lora_policy import load_base_model

    torch.manual_seed(0)
    return load_base_model(tiny_model_dir, "float32", "cpu"), load_tokenizer(tiny_model_dir)


@pytest.mark.slow
def test_the_compiled_step_gives_the_uncompiled_tokens_and_compiles_once_per_bucket(tiny_model_dir):
    """The static loop with its step compiled (torch.compile, Inductor on the CPU) against the
    dynamic loop, fp32, the same row seeds: three calls of other prompt lengths (up to 50 tokens,
    one 64-token bucket) and other prompt counts (3 and 4: one power-of-two bucket) give the
    uncompiled loop's tokens, and only the first call compiles (dynamo's graph count stays)."""
    from torch._dynamo.utils import counters

    from grpo.rollout.sampling import compiled_steps

    model, tok = _dense_fp32(tiny_model_dir)
    tok.padding_side = "left"
    calls = [["What is 1 + 2?", "Hi", "7 * 8 = ?"],
             ["Add 12 and 30, then say the sum twice please.", "2 + 2", "9 - 4", "Ten"],
             ["What is 45 + 67 + 12? Say the number, only that.", "1", "x"]]
    graphs = []
    for i, prompts in enumerate(calls):
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        seeds = list(range(10 * i, 10 * i + 4 * len(prompts)))
        draw = Draw(12, set(range(3, 40)), tok.pad_token_id, 1.5, 0.9, row_seeds=seeds)
        dynamic = decode(model, enc["input_ids"], enc["attention_mask"], 4, draw, DynamicLoop())
        compiled = decode(model, enc["input_ids"], enc["attention_mask"], 4, draw,
                          StaticLoop(StaticLoop.Options(length_bucket=64), compile_step=True))
        assert compiled.shape == dynamic.shape and torch.equal(compiled, dynamic), i
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[1] == graphs[0] and graphs[2] == graphs[0], graphs
    assert list(compiled_steps(model)) == [(16, 64 + 12)]  # 4 prompts x 4 rows, one length bucket


def test_a_call_is_padded_to_its_bucket_and_the_extra_rows_repeat_the_last_prompts():
    """``bucketed_call``: 3 prompts of 5 tokens -> 4 prompts of 8 (bucket 8), the added prompt a copy
    of the last, its completions drawing the last prompt's uniform numbers; masks 0 on the padding."""
    from grpo.rollout.sampling import Sampling, bucketed_call

    ids = torch.arange(15).reshape(3, 5) + 1
    mask = torch.ones(3, 5, dtype=torch.long)
    uniforms = torch.rand(6, 7)  # 3 prompts x 2 completions, 7 tokens
    s = Sampling(7, torch.tensor([0]), 0, 1.0, 1.0, 0, uniforms)
    ids2, mask2, s2 = bucketed_call(ids, mask, s, 2, 8)
    assert ids2.shape == mask2.shape == (4, 8)
    assert torch.equal(ids2[:3, 3:], ids) and torch.equal(ids2[3], ids2[2]) and mask2[:, :3].sum() == 0
    assert torch.equal(s2.uniforms[:6], uniforms) and torch.equal(s2.uniforms[6:], uniforms[4:])
    same, _, same_s = bucketed_call(ids[:2, :4], mask[:2, :4], s, 2, 4)  # already a bucket's shape
    assert same.shape == (2, 4) and same_s is s


def test_plan_decode_picks_the_loop_and_the_compile_by_device_and_call_size():
    """``decode.loop``/``decode.compile_step`` -> ``plan_decode``: auto is dynamic on a CPU, static on
    CUDA with the step compiled once the planned token steps reach ``compile_min_tokens``; ``on``
    picks the static loop under ``auto``; a dynamic loop cannot be compiled (one line naming the key)."""
    from grpo.config.sections.decode import DecodeConfig
    from grpo.rollout.sampling import plan_decode

    auto = DecodeConfig()
    cpu = plan_decode(auto, "cpu", 10**6).loop
    assert type(cpu) is DynamicLoop and not cpu.compiled
    big, small = plan_decode(auto, "cuda", 40 * 512), plan_decode(auto, "cuda", 8 * 64)
    assert type(big.loop) is type(small.loop) is StaticLoop
    assert big.loop.compiled and not small.loop.compiled
    assert big.loop.options is auto.loop_options["static"] and big.loop.options == StaticLoop.Options()
    assert "20480 planned token steps >= decode.compile_min_tokens 1024" in big.why
    assert "512 planned token steps < decode.compile_min_tokens 1024" in small.why
    on = plan_decode(DecodeConfig(compile_step="on"), "cpu", 1)
    assert type(on.loop) is StaticLoop and on.loop.compiled
    assert not plan_decode(DecodeConfig(loop="static", compile_step="off"), "cuda", 10**6).loop.compiled
    with pytest.raises(ValueError, match="decode.compile_step: on needs the static loop"):
        plan_decode(DecodeConfig(loop="dynamic", compile_step="on"), "cuda", 10**6)


@pytest.mark.slow
def test_the_compiled_step_follows_the_policy_as_its_adapter_moves(tiny_model_dir):
    """Training's rollouts (a 4-bit policy with LoRA, decoded on dense copies with the adapter
    folded in) through a compiled step: the dynamic loop's tokens at every call, after the adapter
    moved between calls as an optimizer step moves it, with one compilation: the copies are kept
    and refilled in place (``dequantized_weights(persistent=True)``), not made anew."""
    from torch._dynamo.utils import counters

    from grpo.model.nf4_layers import holds_dense_copies
    from grpo.rollout.rollout_backends import DecodeChoice, TransformersBackend

    model, tok = _policy(tiny_model_dir)
    eager = TransformersBackend(model, tok, decode=DecodeChoice(loop=DynamicLoop()))
    compiled = TransformersBackend(model, tok, decode=DecodeChoice(loop=StaticLoop(compile_step=True)))
    prompts, kw = ["What is 1 + 2?", "Hi", "7 * 8 = ?"], dict(max_new_tokens=10, temperature=1.3, seeds=list(range(12)))
    graphs = []
    for step in range(3):
        want, got = eager.generate(prompts, 4, **kw), compiled.generate(prompts, 4, **kw)
        assert torch.equal(got.completion_ids, want.completion_ids) and got.texts == want.texts, step
        graphs.append(counters["stats"]["unique_graphs"])
        with torch.no_grad():  # an optimizer step's worth of change in every lora_B
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.2 * torch.randn_like(p))
    assert holds_dense_copies(model) and graphs[1] == graphs[0] == graphs[2], graphs


def test_one_compiled_step_per_row_count_is_held_and_release_drops_them(tiny_model_dir):
    """``compiled_step``: a step for as many rows and more positions replaces the shorter one (its
    cache is freed), one of other rows joins it; ``call_shape`` puts a call on the smallest held
    step with room for it (whole groups, the prompt), else a new bucket; ``release_compiled_steps``
    drops every step of the model (made lazily: no compilation runs here)."""
    import gc
    import weakref

    from grpo.rollout.sampling import call_shape, compiled_step, compiled_steps, release_compiled_steps

    model, _ = _dense_fp32(tiny_model_dir)
    cpu = torch.device("cpu")
    first = weakref.ref(compiled_step(model, 4, 32, cpu).cache)
    compiled_step(model, 8, 32, cpu)
    compiled_step(model, 4, 64, cpu)
    gc.collect()
    assert sorted(compiled_steps(model)) == [(4, 64), (8, 32)] and first() is None
    held = compiled_steps(model)
    assert call_shape(3, 1, 40, 20, 16, held) == (4, 44)  # on (4, 64): 4 prompts of 64 - 20 tokens
    assert call_shape(2, 4, 10, 20, 16, held) == (2, 12)  # on (8, 32): 2 groups of 4 rows
    assert call_shape(3, 4, 10, 20, 16, held) == (4, 16)  # 12 rows: none held, a new bucket
    assert release_compiled_steps(model) == 2 and not compiled_steps(model)


@pytest.mark.parametrize("name", DECODE_LOOPS.names())
def test_every_registered_decode_loop_keeps_the_contract(name, tiny_model_dir):
    """Every ``DECODE_LOOPS`` entry, a new one included with no edit here: ``decode.loop`` accepts
    its name and ``plan_decode`` builds an instance of it from the ``decode`` section, with its
    reason in words; uncompiled (``compile_step: off``) it runs a call as it is (``step_shape``),
    the memory split asks it without a compiled call (``split_call``), and its tokens equal the
    dynamic loop's for the same row seeds (sampled with top-p, with ``min_new_tokens``, greedy),
    trailing pads and length included; ``compile_step: on`` builds it compiled where it
    ``compiles``, and is refused in one line where it does not."""
    from grpo.config.sections.decode import DecodeConfig
    from grpo.rollout.decode_memory import CallSize, model_dims, split_call
    from grpo.rollout.sampling import plan_decode

    plan = plan_decode(DecodeConfig(loop=name, compile_step="off"), "cpu", 10**6)
    loop = plan.loop
    assert type(loop) is DECODE_LOOPS[name] and not loop.compiled and plan.why and "\n" not in plan.why
    assert loop.step_shape(3, 4, 7, 20) == (3, 7)
    model, tok = _dense_fp32(tiny_model_dir)
    assert split_call(model_dims(model), CallSize(3, 4, 7, 20), 2**40, 64, loop) == (3, None)
    tok.padding_side = "left"
    enc = tok(["What is 1 + 2?", "Hi", "7 * 8 = ?"], return_tensors="pt", padding=True, add_special_tokens=False)
    for temperature, top_p, min_new in [(1.5, 0.9, 0), (1.5, 1.0, 5), (0.0, 1.0, 0)]:
        draw = Draw(16, set(range(3, 40)), tok.pad_token_id, temperature, top_p, min_new, list(range(50, 62)))
        want = decode(model, enc["input_ids"], enc["attention_mask"], 4, draw, DynamicLoop())
        got = decode(model, enc["input_ids"], enc["attention_mask"], 4, draw, loop)
        assert got.shape == want.shape and torch.equal(got, want), (name, temperature)
    on = DecodeConfig(loop=name, compile_step="on")
    if DECODE_LOOPS[name].compiles:
        assert plan_decode(on, "cpu").loop.compiled
    else:
        with pytest.raises(ValueError, match=r"^decode.compile_step: on needs the [a-z_ ]+ loop; set decode.loop: "):
            plan_decode(on, "cpu")


def test_the_static_loops_options_are_its_own_under_decode_loop_options():
    """``StaticLoop.Options`` are read from ``decode.loop_options.static`` (its own defaults where
    left out, the defaults of a loop built without the section: benches, tests); ``plan_decode``
    builds the loop from them, ``compile_step`` its own flag; the loop without options has no entry."""
    from grpo.config.sections.decode import DecodeConfig
    from grpo.rollout.sampling import plan_decode

    assert StaticLoop().options == DecodeConfig().loop_options["static"] and not StaticLoop().compiled
    assert DynamicLoop.Options is None and set(DecodeConfig().loop_options) == set(DECODE_LOOPS.with_options())
    cfg = DecodeConfig(loop="static", loop_options={"static": {"check_every": 4}}, compile_step="on")
    loop = plan_decode(cfg, "cpu").loop
    assert loop.options == StaticLoop.Options(check_every=4, length_bucket=64) and loop.compiled
