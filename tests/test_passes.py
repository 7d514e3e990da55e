"""The passes over the policy (``grpo.training.passes``) on the tiny 4-bit + LoRA Llama: micro-batch slices; the
no-grad pass's fixed log-probs (the reference policy's with the adapter off) as a new record; the step's
entropy threshold, the kept side of it (``entropy_rule``) and its gradients; the engine gap by hand;
micro-batches change memory and not the update; updates raise the rewarded completion."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm.entropy import build_token_rule
from grpo.algorithm.loss import LossSettings
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.core.types import TrainBatch
from grpo.data.sources import build_prompt
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.rollout.rollout_backends import TransformersBackend
from grpo.training.passes import PolicyPasses, micro_slices
from grpo.training.trainer_builder import loss_of
from grpo.training.updater import AdamWUpdater

from .helpers import LORA, give_adapter_a_say, make_trainer


def _passes(model, cfg: TrainConfig) -> PolicyPasses:
    """The passes as the trainer builds them, one process, AdamW on the LoRA parameters, the rule
    and the loss of ``cfg.loss``."""
    params = [p for p in model.parameters() if p.requires_grad]
    return PolicyPasses(model, cfg, Dist(), AdamWUpdater(params, cfg, Dist()), build_token_rule(cfg.loss), loss_of(cfg))


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _hand_batch(tok, advantages: list[float]) -> TrainBatch:
    """One prompt and the completions "#### 7" and "it is 9" (EOS-terminated, right-padded), twice:
    (4, C) rows good, bad, good, bad."""
    prompt = tok(["<|im_start|>user\n3+4?<|im_end|>\n<|im_start|>assistant\n"], add_special_tokens=False)["input_ids"][0]
    good, bad = tok(["#### 7<|im_end|>", "it is 9<|im_end|>"], add_special_tokens=False)["input_ids"]
    width = max(len(good), len(bad))
    pad = tok.pad_token_id
    targets = torch.tensor([good + [pad] * (width - len(good)), bad + [pad] * (width - len(bad))] * 2)  # (4, C)
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in (good, bad, good, bad)])  # (4, C)
    ids = torch.cat([torch.tensor([prompt] * 4), targets], dim=1)  # (4, P + C)
    attn = torch.cat([torch.ones(4, len(prompt), dtype=torch.long), mask], dim=1)
    return TrainBatch(ids, attn, targets, mask, torch.tensor(advantages), len(prompt))


@pytest.mark.parametrize(("n", "micro_batches", "group", "sizes"), [
    (8, 1, 4, [8]),           # one micro-batch: the whole step
    (8, 2, 4, [4, 4]),        # a group each
    (12, 2, 4, [8, 4]),       # 6 rows would split a group: rounded up to whole groups, the first the largest
    (16, 3, 4, [8, 8]),       # 6 -> 8: whole groups give two micro-batches, not three
    (8, 4, 4, [2, 2, 2, 2]),  # smaller than a group: groups are split
    (5, 2, 1, [3, 2]),        # groups of one: plain ceil(n / micro_batches)
    (3, 8, 2, [1, 1, 1]),     # more micro-batches than rows: one row each
])
def test_micro_slices_cover_the_rows_in_whole_groups_where_possible(n, micro_batches, group, sizes):
    slices = micro_slices(n, micro_batches, group)
    assert [s.stop - s.start for s in slices] == sizes
    assert slices[0].start == 0 and slices[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))  # contiguous, in order


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    """The tiny 4-bit model with an fp32 LoRA adapter that has a say (tests here leave its weights
    as they are), and its tokenizer."""
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
    give_adapter_a_say(model, std=0.3)
    return model.eval(), load_tokenizer(tiny_model_dir)


def _forward_logprobs(model, batch: TrainBatch) -> torch.Tensor:
    """(n, C) log-probs of the targets from one plain forward of the whole rows (no shared prompt,
    full log-softmax): the reference the no-grad pass is checked against."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()  # (n, P+C, V)
    start = batch.prompt_len - 1  # the logits at position t predict the token at t + 1
    logp = torch.log_softmax(logits[:, start:start + batch.targets.shape[1]], dim=-1)  # (n, C, V)
    return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_fixed_logprobs_fill_the_reference_in_a_new_batch_and_leave_the_input_as_it_was(policy, beta):
    """``beta > 0``: ``ref_logp`` is the policy's with the adapter off (a plain forward under
    ``disable_adapter``), in a new record; the input keeps its ``None`` fields. Without a KL term no
    pass runs (the batch itself comes back). ``old_logp`` is never filled here, ``mu`` 2 or not: the
    first update gives it (``test_the_first_update_gives_old_logp_...``)."""
    model, tok = policy
    batch = _hand_batch(tok, [1.0, -1.0, 1.0, -1.0])
    cfg = TrainConfig(rollouts={"group_size": 4}, loss={"beta": beta, "entropy_rule": "high"}, optimizer={"mu": 2}, passes={"logprob_chunk": 5})  # no KL of its own: beta's pass
    fixed = _passes(model, cfg).fixed_logprobs(batch)
    assert batch.ref_logp is None and batch.old_logp is None and fixed.old_logp is None
    if not beta:
        assert fixed is batch
        return
    assert fixed is not batch and fixed.input_ids is batch.input_ids and fixed.sampling_logp is None
    valid = batch.mask.bool()
    with model.disable_adapter():
        reference = _forward_logprobs(model, batch)
    assert fixed.ref_logp.shape == batch.mask.shape
    torch.testing.assert_close(fixed.ref_logp[valid], reference[valid], rtol=0, atol=1e-4)
    own = _forward_logprobs(model, batch)  # the adapter has a say: the two policies differ
    assert (fixed.ref_logp - own)[valid].abs().max() > 1e-3


@pytest.mark.parametrize("rule", ["high", "archer"])
def test_the_first_update_gives_old_logp_the_values_of_a_no_grad_pass(policy, rule):
    """One update's detached log-probs (``Accumulated.logp``) are, at every valid token, exactly the
    no-grad pass's at the same weights: what ``GRPOTrainer.update`` uses as ``old_logp`` for the
    later updates of ``mu`` in place of a pass of its own."""
    model, tok = policy
    batch = _hand_batch(tok, [1.0, -1.0, 0.5, -0.5])
    passes = _passes(model, TrainConfig(rollouts={"group_size": 4}, loss={"entropy_rule": rule}, passes={"logprob_chunk": 5}))
    batch = passes.fixed_logprobs(batch)  # archer's KL: the reference log-probs
    _entropy, expected = passes.no_grad_pass(batch, adapter=True)  # (4, C)
    model.train()
    model.zero_grad(set_to_none=True)
    got = passes.accumulate_gradients(batch, float(batch.mask.sum())).logp
    valid = batch.mask.bool()
    assert got.shape == batch.mask.shape and not got.requires_grad
    assert torch.equal(got[valid], expected[valid])


def test_the_step_threshold_is_the_quantile_of_the_valid_entropies(policy):
    """Valid entropies 0.1 0.9 0.5 0.3 0.7 (the 9.0s are padding): the top 0.25 -> the 0.75 quantile,
    0.7 (index 3 of the sorted five); the top 0.4 -> 0.58 (linear between 0.5 and 0.7). The threshold
    is the same whichever side ``entropy_rule`` trains; ``entropy_top_quantile`` 1 has none."""
    model, _ = policy
    entropy = torch.tensor([[0.1, 0.9, 0.5, 9.0], [0.3, 0.7, 9.0, 9.0]])  # (2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    for keep in ("high", "low"):
        for quantile, threshold in ((0.25, 0.7), (0.4, 0.58)):
            passes = _passes(model, TrainConfig(loss={"entropy_rule_options": {keep: {"top_quantile": quantile}}, "entropy_rule": keep}))
            assert passes.step_threshold(entropy, mask).item() == pytest.approx(threshold, abs=1e-6)
    assert _passes(model, TrainConfig(loss={"entropy_rule": "high", "entropy_rule_options": {"high": {"top_quantile": 1.0}}})).step_threshold(entropy, mask) is None


def test_step_normalizer_of_one_process_by_hand(policy):
    """The mask of 5 valid tokens in 2 rows of 4: dapo 5 (valid tokens), grpo 2 (rows), dr_grpo
    2 x max_new_tokens 6."""
    model, _ = policy
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    got = {t: _passes(model, TrainConfig(loss={"loss_type": t}, rollouts={"max_new_tokens": 6})).step_normalizer(mask)
           for t in ("dapo", "grpo", "dr_grpo")}
    assert got == {"dapo": 5.0, "grpo": 2.0, "dr_grpo": 12.0}


def test_entropy_rule_low_trains_the_complement_of_high(policy):
    """One micro-batch through ``loss_backward`` at ``entropy_top_quantile`` 0.3: ``high`` keeps the
    valid tokens at or above the step's threshold, ``low`` exactly the other valid tokens; the entropies
    and the loss value are the same (tokens outside the mask carry their detached log-probs). On
    policy (``mu`` 1, ratio 1, no clipping) the loss is linear in the kept tokens: the LoRA gradients of
    ``high`` and ``low`` add up to those of every token kept. A threshold passed in is used as given."""
    model, tok = policy
    batch = _hand_batch(tok, [1.0, -1.0, 0.5, -0.5])
    normalizer = float(batch.mask.sum())
    out = {}
    for name, quantile, keep in (("high", 0.3, "high"), ("low", 0.3, "low"), ("all", 1.0, "high")):
        passes = _passes(model, TrainConfig(rollouts={"group_size": 4}, loss={"entropy_rule_options": {keep: {"top_quantile": quantile}}, "entropy_rule": keep}))
        model.zero_grad(set_to_none=True)
        loss, stats, entropy, kept, _logp = passes.loss_backward(batch, normalizer)
        out[name] = (loss, entropy, kept, _lora_grads(model))
    model.zero_grad(set_to_none=True)
    valid = batch.mask.bool()
    (loss_h, ent_h, high, g_high), (loss_l, ent_l, low, g_low), (loss_a, _, every, g_all) = out.values()
    torch.testing.assert_close(ent_l, ent_h, rtol=0, atol=0)
    threshold = torch.quantile(ent_h[valid], 0.7)
    assert torch.equal(high, (ent_h >= threshold) & valid) and 0 < high.sum() < valid.sum()
    assert torch.equal(low, valid & ~high) and torch.equal(every, valid)
    assert loss_l == pytest.approx(loss_h, abs=1e-6) and loss_a == pytest.approx(loss_h, abs=1e-6)
    for n in g_all:
        torch.testing.assert_close(g_high[n] + g_low[n], g_all[n], rtol=0, atol=1e-6)
    assert any(g.abs().max() > 1e-4 for g in g_low.values()) and any(g.abs().max() > 1e-4 for g in g_high.values())
    passes = _passes(model, TrainConfig(rollouts={"group_size": 4}, loss={"entropy_rule_options": {"high": {"top_quantile": 0.3}}, "entropy_rule": "high"}))
    given = ent_h[valid].min()  # every valid token is at or above it
    assert torch.equal(passes.loss_backward(batch, normalizer, given)[3], valid)
    model.zero_grad(set_to_none=True)


def test_engine_gap_and_truncated_importance_weights_by_hand(policy):
    """The trainer's old log-probs against the engine's on two valid tokens (the third is padding):
    gaps 0.5 and 1.0 -> sum 1.5, max 1.0; weights exp(0.5) = 1.65 capped at 1.5 and exp(-1) = 0.368
    (the padding's weight is not summed); correction off: no weights, the gap alone; a batch the policy
    sampled itself has no gap."""
    model, tok = policy
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    batch = TrainBatch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long),
                       torch.zeros(1, 3, dtype=torch.long), torch.tensor([[1, 1, 0]]), torch.ones(1), 1,
                       sampling_logp=torch.tensor([[-1.5, -1.0, -3.0]]))
    cfg = TrainConfig(rollouts={"importance_sampling_cap": 1.5})
    weights, stats = _passes(model, cfg).engine_gap(batch, old)
    assert stats == pytest.approx({"mismatch_sum": 1.5, "mismatch_max": 1.0, "is_weight_sum": 1.5 + math.exp(-1)})
    torch.testing.assert_close(weights, torch.tensor([[1.5, math.exp(-1), 1.5]]))
    weights, stats = _passes(model, TrainConfig(rollouts={"importance_sampling_cap": None})).engine_gap(batch, old)
    assert weights is None and stats == pytest.approx({"mismatch_sum": 1.5, "mismatch_max": 1.0})
    batch.sampling_logp = None
    assert _passes(model, cfg).engine_gap(batch, old) == (None, {})


@pytest.mark.parametrize("quantile", [1.0, 0.2])
def test_updates_raise_the_rewarded_completion(tiny_model_dir, tmp_path, quantile):
    """A group with one rewarded and one unrewarded completion (each twice): a few GRPO updates
    raise the log-likelihood of the rewarded one relative to the other (by 1.7 nats with every
    token kept, 0.3 with the top 20%, when this was written)."""
    from grpo.algorithm.logprobs import chunked_entropy_logprobs, completion_hidden
    from grpo.algorithm.loss import group_advantages

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    cfg = TrainConfig(output_dir=str(tmp_path), rollouts={"group_size": 4}, optimizer={"lr": 3e-3, "warmup_steps": 0}, loss={"entropy_rule_options": {"high": {"top_quantile": quantile}}, "entropy_rule": "high"})  # the mask at quantile
    passes = _passes(model, cfg)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
    batch = _hand_batch(tok, adv.tolist())

    def seq_logp() -> torch.Tensor:
        with torch.no_grad():
            hidden = completion_hidden(passes.body, batch.input_ids, batch.attention_mask, batch.prompt_len)
            return (chunked_entropy_logprobs(hidden, passes.lm_head, batch.targets)[1] * batch.mask).sum(1)

    start = seq_logp()
    for _ in range(8):
        passes.loss_backward(batch, LossSettings().normalizer(batch.mask))
        passes.updater.optimizer.step()
        passes.updater.optimizer.zero_grad()
    end = seq_logp()
    assert end[1] < start[1]  # the unrewarded completion is pushed down
    assert (end[0] - end[1]) - (start[0] - start[1]) > 0.2


@pytest.mark.parametrize("mu, rule", [(1, "high"), (2, "high"), (1, "archer")])
def test_micro_batches_change_memory_not_the_update(tiny_model_dir, tiny_problems, tmp_path, monkeypatch, mu, rule):
    """The same rollouts through micro_batches 1 and 4: the same kept tokens (the entropy threshold
    is the step's, not each micro-batch's) and the same accumulated LoRA gradients. The no-grad
    policy pass that gives the threshold runs once with 4 micro-batches where the rule needs a
    statistic (``high``), never where it needs none (``archer``, its KL off: a per-response cut)."""

    policy_passes = []
    real_no_grad = PolicyPasses.no_grad_pass

    def spy_no_grad(self, batch, *, adapter):
        policy_passes.append(self.cfg.passes.micro_batches)
        return real_no_grad(self, batch, adapter=adapter)

    monkeypatch.setattr(PolicyPasses, "no_grad_pass", spy_no_grad)

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
    give_adapter_a_say(model, std=0.3)  # non-zero adapter: gradients reach A and B
    fields = dict(output_dir=str(tmp_path), rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 10}, checkpoints={"every": 0}, loss={"entropy_rule_options": {"high": {"top_quantile": 0.2}, "archer": {"kl_low": 0.0}, "sent_kl": {"kl_low": 0.0}}, "entropy_rule": rule}, optimizer={"mu": mu})
    one = _passes(model, TrainConfig(**fields, passes={"micro_batches": 1}))
    four = _passes(model, TrainConfig(**fields, passes={"micro_batches": 4}))
    prompts = [build_prompt(tok, r["question"], "Answer as '#### N'.") for r in tiny_problems[:2]]
    rollout = TransformersBackend(model, tok, min_new_tokens=3).generate(prompts, 4, max_new_tokens=10)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, -0.3, 1.2, -1.2])  # (N,)
    batch = TrainBatch.from_rollout(rollout, advantages, torch.device("cpu"))
    assert len(four.slices(len(batch))) == 4
    normalizer = LossSettings().normalizer(batch.mask)  # dapo's
    results = []
    for passes in (one, four):
        model.train()
        model.zero_grad(set_to_none=True)
        sums, keep, _logp = passes.accumulate_gradients(batch, normalizer)
        results.append((sums, keep, _lora_grads(model)))
    (s1, keep1, g1), (s4, keep4, g4) = results
    assert policy_passes == ([4] if four.rule.needs_statistic() else [])
    assert torch.equal(keep1, keep4)
    if rule == "high":
        assert 0 < keep1.sum() < batch.mask.sum()  # the mask really selects
    else:
        assert torch.equal(keep1, batch.mask.bool())  # every valid token
    assert s1["kept"] == s4["kept"] and s1["loss"] == pytest.approx(s4["loss"], abs=1e-6)
    for n in g1:
        torch.testing.assert_close(g4[n], g1[n], rtol=0, atol=1e-5)
    assert any(g.abs().max() > 1e-4 for g in g1.values())


def test_rules_that_keep_every_token_train_every_token_with_the_reference(tiny_model_dir, tiny_problems, tmp_path,
                                                                          monkeypatch):
    """One real training step per rule at ``beta`` 0, the same rollouts (seeded) and an adapter that
    has a say (the policy differs from the reference): ``archer`` and ``sent_kl`` run the reference
    pass (``ref_logp`` filled), keep every valid token (``kept_frac`` 1) and every row (the KL term
    has a gradient at zero advantage: ``update_frac`` 1), log a positive KL, and their loss is
    ``high``'s plus their KL term (the ratio is 1 on policy, so only the KL changes its value)."""
    from grpo.algorithm.rewards import REWARDS

    refs: list[torch.Tensor | None] = []
    real = PolicyPasses.fixed_logprobs

    def spy(self, batch):
        fixed = real(self, batch)
        refs.append(fixed.ref_logp)
        return fixed

    monkeypatch.setattr(PolicyPasses, "fixed_logprobs", spy)
    rows = {}
    with REWARDS.registered("toy_chars", lambda completions, answers: [float(len(c)) for c in completions]):
        for rule in ("high", "archer", "sent_kl"):
            cfg = TrainConfig(output_dir=str(tmp_path / rule), steps=1, rewards={"toy_chars": 1.0}, truncated="score", rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "backend": "transformers"}, checkpoints={"every": 0, "eval_every": 0}, optimizer={"warmup_steps": 0, "mu": 1, "equal_reward_groups": "auto"}, wandb={"mode": "disabled"}, loss={"entropy_rule": rule, "entropy_rule_options": {"high": {"top_quantile": 0.2}}})
            torch.manual_seed(0)
            model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
            give_adapter_a_say(model, std=0.3)
            rows[rule] = make_trainer(model, load_tokenizer(tiny_model_dir), cfg, tiny_problems).train_step()
    high, archer, sent = rows["high"], rows["archer"], rows["sent_kl"]
    assert refs[0] is None and refs[1] is not None and refs[2] is not None
    assert high["kl"] == 0 and 0 < high["kept_frac"] < 1
    for row in (archer, sent):
        assert row["kept_frac"] == 1.0 and row["update_frac"] == 1.0 and row["kl"] > 0
        assert row["loss"] > high["loss"] and row["loss"] - high["loss"] < 0.001 * row["kl"] + 1e-6
        assert row["reward_mean"] == high["reward_mean"]  # the same rollouts


def test_where_the_rule_acts_is_counted_from_the_update_itself(policy):
    """``loss_backward``'s counters on the hand batch. ``high`` and ``low`` at 0.3 keep complementary
    tokens, so their kept parts of the (same) policy gradient add up to all of it, and ``high`` keeps
    less than all. ``archer`` with old log-probs set so that every ratio is 1.3 on rewarded rows and
    0.7 on the others: its high-entropy tokens (``per_response_high``) are its wider-clip tokens,
    every one in the band plain PPO clips (1.2) and archer does not (1.5), and the ordinary tokens
    are clipped, so the band carries all of the policy gradient."""
    from dataclasses import replace

    from grpo.algorithm.entropy import per_response_high

    model, tok = policy
    batch = _hand_batch(tok, [1.0, -1.0, 0.5, -0.5])
    normalizer = float(batch.mask.sum())
    kept = {}
    for rule in ("high", "low"):
        passes = _passes(model, TrainConfig(rollouts={"group_size": 4}, loss={"entropy_rule_options": {rule: {"top_quantile": 0.3}}, "entropy_rule": rule}))
        stats = passes.loss_backward(batch, normalizer)[1]
        kept[rule] = stats["kept_grad"]
        assert "wide_tokens" not in stats and stats["policy_grad_abs"] > 0
    assert kept["high"] + kept["low"] == pytest.approx(stats["policy_grad_abs"], rel=1e-5)
    assert 0 < kept["high"] < stats["policy_grad_abs"]

    cfg = TrainConfig(rollouts={"group_size": 4}, loss={"entropy_rule_options": {"archer": {"top_quantile": 0.2}}, "entropy_rule": "archer"}, optimizer={"mu": 2})
    passes = _passes(model, cfg)
    entropy, logp = passes.no_grad_pass(batch, adapter=True)
    shift = torch.where(batch.advantages > 0, math.log(1.3), math.log(0.7)).unsqueeze(1)  # (4, 1)
    moved = replace(batch, old_logp=logp - shift, ref_logp=logp)
    stats = passes.loss_backward(moved, normalizer)[1]
    model.zero_grad(set_to_none=True)
    high = per_response_high(entropy, batch.mask, 0.2)
    assert 0 < stats["wide_tokens"] == float(high.sum()) < float(batch.mask.sum())
    assert stats["band_tokens"] == stats["wide_tokens"]
    assert stats["band_grad"] == pytest.approx(stats["policy_grad_abs"], rel=1e-5)
    assert "kept_grad" not in stats  # archer drops no token
