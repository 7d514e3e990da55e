"""The trainer (``grpo.training.trainer``) on a tiny random model: gradients reach only LoRA and follow the mask,
generation micro-batches, the logged curriculum stage, and the groups without signal left out of the
update (the passes themselves, micro-batches and the update's direction: tests/test_passes.py)."""

from __future__ import annotations

import json

import pytest
import torch

from grpo.algorithm.rewards import REWARDS
from grpo.config.overlay import overlay_params
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.types import TrainBatch
from grpo.data.sources import build_prompt
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.rollout.rollout_backends import TransformersBackend

from .helpers import LORA, give_adapter_a_say, make_trainer


@pytest.mark.slow
def test_trainer_gradients_reach_only_lora_and_follow_the_mask(tiny_model_dir, tiny_problems, tmp_path, monkeypatch):
    # a reward that differs within every group (completion length in characters), so the
    # advantages are non-zero whatever the random tiny model samples
    monkeypatch.setitem(REWARDS, "chars", lambda completions, answers: [float(len(c)) for c in completions])
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    q = 0.2  # the mask's share of the tokens
    cfg = TrainConfig(
        output_dir=str(tmp_path), steps=2, rewards={"chars": 0.1}, rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8}, checkpoints={"every": 0}, optimizer={"mu": 2, "equal_reward_groups": "auto"},
        loss={"beta": 0.05, "entropy_rule": "high", "entropy_rule_options": {"high": {"top_quantile": q}}}, passes={"micro_batches": 2},
    )
    trainer = make_trainer(model, tok, cfg, tiny_problems)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rows = trainer.train(progress=False)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["kept_frac"] <= q + 0.1  # ties at the threshold are kept
        assert r["completion_len"] > 0 and r["step_time_s"] > 0
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed  # AdamW moved the LoRA weights (lr warm-up starts above zero)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_with_mu_2_the_first_update_gives_the_later_ones_old_logp(tiny_model_dir, tiny_problems, tmp_path, micro_batches):
    """``GRPOTrainer.update`` at ``mu`` 2 from rollouts without ``old_logp`` ends at the same LoRA
    weights, bit for bit, as from the same rollouts given ``old_logp`` by a no-grad pass at the
    sampling weights (the pass the trainer no longer runs), and not where two on-policy updates
    (``mu`` 1, twice) end: the second update is off policy. ``high`` at 0.3 with 2 micro-batches
    takes its threshold from a no-grad pass at each update's weights."""
    from dataclasses import replace

    from grpo.training.metrics import PhaseTimer

    tok = load_tokenizer(tiny_model_dir)
    fields = dict(output_dir=str(tmp_path), rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8}, checkpoints={"every": 0}, optimizer={"mu": 2, "warmup_steps": 0, "lr": 0.05, "lr_schedule": "constant"}, loss={"entropy_rule": "high", "entropy_rule_options": {"high": {"top_quantile": 0.3}}}, passes={"micro_batches": micro_batches})
    ends = {}
    for way in ("first update", "no-grad pass", "on policy twice"):
        torch.manual_seed(0)
        model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
        give_adapter_a_say(model, std=0.3)
        mu = 1 if way == "on policy twice" else 2
        trainer = make_trainer(model, tok, TrainConfig(**{**fields, "optimizer": {**fields["optimizer"], "mu": mu}}), tiny_problems)
        prompts = [build_prompt(tok, r["question"], "Answer as '#### N'.") for r in tiny_problems[:2]]
        rollout = TransformersBackend(model, tok, min_new_tokens=3).generate(prompts, 4, max_new_tokens=8)
        batch = TrainBatch.from_rollout(rollout, torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, -0.3, 1.2, -1.2]), torch.device("cpu"))
        if way == "no-grad pass":
            batch = replace(batch, old_logp=trainer.passes.no_grad_pass(batch, adapter=True)[1])
        for _ in range(3 - mu):
            trainer.update(batch, trainer.passes.step_normalizer(batch.mask), batch.mask, PhaseTimer())
        ends[way] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    lazy, passed, on_policy = ends["first update"], ends["no-grad pass"], ends["on policy twice"]
    for n in lazy:
        assert torch.equal(lazy[n], passed[n]), n
    assert any(not torch.equal(lazy[n], on_policy[n]) for n in lazy)


def test_generation_micro_batches_keep_groups_contiguous_and_fixed_length(tiny_model_dir, tiny_problems, tmp_path):
    """generation_batch_size 3 with 2 prompts x G=4: each group split over calls of 3 and 1 (a call
    never mixes prompts, so each prompt is prefilled once); min_new_tokens = max_new_tokens makes
    every completion full length."""
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    cfg = TrainConfig(output_dir=str(tmp_path), rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 5, "generation_batch_size": 3}, checkpoints={"every": 0})
    backend = TransformersBackend(model, tok, min_new_tokens=5)
    calls = []
    generate = backend.generate
    backend.generate = lambda prompts, n, **kw: calls.append(len(prompts) * n) or generate(prompts, n, **kw)
    trainer = make_trainer(model, tok, cfg, tiny_problems, backend=backend)
    prompts = ["What is 1 + 2?", "Hi"]
    roll = trainer.rollout(prompts)
    assert calls == [3, 1, 3, 1]
    assert roll.completion_ids.shape == (8, 5) and roll.completion_mask.sum().item() == 40
    real = [tok.decode(ids[m.bool()]) for ids, m in zip(roll.prompt_ids, roll.prompt_mask)]
    assert real == [prompts[0]] * 4 + [prompts[1]] * 4
    row = trainer.train_step()
    assert row["completion_len"] == 5 and row["time_optimizer_s"] > 0


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_logged_stage_is_the_stage_the_rows_came_from(tiny_model_dir, tiny_problems, tmp_path):
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    cfg = TrainConfig(output_dir=str(tmp_path), steps=6, order_options={"curriculum": {"num_stages": 3}}, rollouts={"prompts_per_step": 1, "group_size": 2, "max_new_tokens": 3}, checkpoints={"every": 0}, optimizer={"warmup_steps": 0})
    trainer = make_trainer(model, tok, cfg, tiny_problems)
    stage_of_question = {tiny_problems[i]["question"]: s for s, idx in enumerate(trainer.stages) for i in idx}
    rows = trainer.train(progress=False)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == [0, 0, 1, 1, 2, 2]
    for r in rows:
        drawn = {stage_of_question[s["question"]] for s in samples if s["step"] == r["step"]}
        assert drawn == {r["stage"]}, r["step"]


def test_groups_without_signal_leave_the_update_unchanged(tiny_model_dir, tiny_problems, tmp_path):
    """A step of three groups, the middle one rewarded alike: ``update_rows`` drops it, and with
    every token kept the update over the other two (the loss normalised over all three) has the
    gradients of the update over all three. With ``beta > 0`` nothing is dropped; a process whose
    groups all lack signal keeps one group with every token masked out (it gives no gradient)."""
    from grpo.algorithm.loss import group_advantages
    from grpo.core.types import StepRollouts

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
    give_adapter_a_say(model, std=0.3)
    fields = dict(output_dir=str(tmp_path), rollouts={"prompts_per_step": 3, "group_size": 4, "max_new_tokens": 8}, checkpoints={"every": 0}, loss={"entropy_rule": "high", "entropy_rule_options": {"high": {"top_quantile": 1.0}}}, optimizer={"mu": 1})
    trainer = make_trainer(model, tok, TrainConfig(**fields), tiny_problems)
    prompts = [build_prompt(tok, r["question"], "Answer as '#### N'.") for r in tiny_problems[:3]]
    rollout = TransformersBackend(model, tok, min_new_tokens=3).generate(prompts, 4, max_new_tokens=8)
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0])  # (12,): group 1 all alike
    advantages = group_advantages(rewards, 4)
    scored = StepRollouts(tiny_problems[:3], 0, ["1"] * 12, rollout, rewards.tolist(), rewards, {}, advantages)
    batch = TrainBatch.from_rollout(rollout, advantages, torch.device("cpu"))
    normalizer = trainer.passes.step_normalizer(batch.mask)

    rows = trainer.update_rows(batch, scored)
    assert torch.equal(rows.input_ids, torch.cat([batch.input_ids[:4], batch.input_ids[8:]]))
    grads = []
    for part in (batch, rows):
        model.zero_grad(set_to_none=True)
        trainer.passes.accumulate_gradients(part, normalizer)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-6)
    assert any(g.abs().max() > 1e-4 for g in grads[0].values())

    with_kl = make_trainer(model, tok, TrainConfig(**{**fields, "loss": {**fields["loss"], "beta": 0.04},
                                                      "optimizer": {"mu": 1, "equal_reward_groups": "auto"}}), tiny_problems)
    assert with_kl.update_rows(batch, scored) is batch
    rank = StepRollouts(tiny_problems[1:2], 1, ["1"] * 4, rollout, rewards[4:8].tolist(), rewards, {}, advantages[4:8])
    placeholder = trainer.update_rows(batch[4:8], rank)  # this process holds the uniform group only
    assert len(placeholder) == 4 and placeholder.mask.sum() == 0

    # the choice of its own (train.optimizer.equal_reward_groups): keep without a KL term, drop beside one
    keep = make_trainer(model, tok, TrainConfig(**{**fields, "optimizer": {"mu": 1, "equal_reward_groups": "keep"}}),
                       tiny_problems)
    assert keep.update_rows(batch, scored) is batch
    drop = make_trainer(model, tok, TrainConfig(**{**fields, "loss": {**fields["loss"], "beta": 0.04},
                                                  "optimizer": {"mu": 1, "equal_reward_groups": "drop"}}), tiny_problems)
    assert torch.equal(drop.update_rows(batch, scored).input_ids, rows.input_ids)


@pytest.mark.slow
def test_the_acting_counts_take_only_tokens_of_nonzero_advantage_after_the_first_update(tiny_model_dir, tiny_problems,
                                                                                         tmp_path):
    """``PolicyPasses.rule_action``'s counts on hand-set ratios: in the first update (no ``old_logp``) only
    the rows of zero advantage are counted; after it, the tokens of the rows with an advantage, and
    of them those whose ratio the clip binds on the side that removes the gradient."""
    from dataclasses import replace

    from grpo.algorithm.entropy import LossTerms
    from grpo.algorithm.loss import group_advantages

    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
    fields = dict(output_dir=str(tmp_path), rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
                  checkpoints={"every": 0})
    trainer = make_trainer(model, tok, TrainConfig(**fields), tiny_problems)
    prompts = [build_prompt(tok, r["question"], "Answer as '#### N'.") for r in tiny_problems[:2]]
    rollout = TransformersBackend(model, tok, min_new_tokens=3).generate(prompts, 4, max_new_tokens=8)
    advantages = group_advantages(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1]), 4)  # (8,): group 1 all alike
    batch = TrainBatch.from_rollout(rollout, advantages, torch.device("cpu"))
    valid = batch.mask.bool()  # (8, C)
    norm = trainer.passes.step_normalizer(batch.mask)

    def counts_of(part, logp, old_logp):
        return trainer.passes.rule_action(part, logp, old_logp, valid, LossTerms(), norm)

    first = counts_of(batch, torch.zeros(valid.shape), torch.zeros(valid.shape))
    assert first["zero_adv_rows"] == 4.0 and not {"acting_tokens", "clipped_acting"} & set(first)
    logp = torch.zeros(valid.shape)  # (8, C)
    ratio = torch.ones(valid.shape)
    ratio[:, ::2] = 1.5  # above 1 + 0.2: binds where A > 0
    ratio[:, 1::4] = 0.5  # below 1 - 0.2: binds where A < 0
    later = replace(batch, old_logp=logp - ratio.log())
    counts = counts_of(later, logp, later.old_logp)
    adv = advantages.unsqueeze(1)
    acting = valid & (adv != 0)
    binds = ((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    assert counts["acting_tokens"] == float(acting.sum()) == float(valid[:4].sum())
    assert 0 < counts["clipped_acting"] == float((binds & acting).sum()) < counts["acting_tokens"]
    assert "wide_acting" not in counts  # no per-token bounds: no band


def _nan_trainer(tiny_model_dir, tiny_problems, tmp_path, monkeypatch, bad_calls, **cfg):
    """A trainer whose reward is the completion's length, and infinite at the reward calls (one a
    step) in ``bad_calls``: that step's advantages, loss and gradients are not finite."""
    calls = []

    def boom(completions, answers):
        calls.append(1)
        bad = len(calls) in bad_calls
        return [float("inf") if bad else float(len(c)) for c in completions]

    monkeypatch.setitem(REWARDS, "boom", boom)
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    base = {"output_dir": str(tmp_path), "rewards": {"boom": 0.1}, "truncated": "score",
            "rollouts": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
            "checkpoints": {"every": 0, "eval_every": 0}, "optimizer": {"warmup_steps": 0, "lr": 1e-2}}
    train = TrainConfig(**overlay_params({"train": base}, {"train": cfg})["train"])
    return make_trainer(model, tok, train, tiny_problems), model


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_a_non_finite_step_applies_no_update_and_training_goes_on(tiny_model_dir, tiny_problems, tmp_path,
                                                                  monkeypatch, caplog):
    """Step 2's rewards are infinite: its loss and gradients are NaN. Its update is not applied (the
    LoRA weights and AdamW's moments stay as step 1 left them), the row says so with nulls for the
    non-finite values, a warning names the step, and steps 3 and 4 update again."""
    trainer, model = _nan_trainer(tiny_model_dir, tiny_problems, tmp_path, monkeypatch, bad_calls={2}, steps=4)
    lora = lambda: {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}  # noqa: E731
    moments = lambda: [s["exp_avg"].clone() for s in trainer.updater.optimizer.state.values()]  # noqa: E731
    snapshots = []
    trainer.callbacks.append(lambda row: snapshots.append((row["step"], lora(), moments())))
    with caplog.at_level("WARNING", logger="grpo.training.trainer"):
        rows = trainer.train(progress=False)
    assert [r.get("update_skipped", 0) for r in rows] == [0, 1, 0, 0]
    assert rows[1]["loss"] is None and rows[1]["reward_mean"] is None and rows[0]["loss"] is not None
    (_, after1, m1), (_, after2, m2), (_, after3, _), _ = snapshots
    assert all(torch.equal(after1[n], after2[n]) for n in after1)  # step 2 changed no weight
    assert all(torch.equal(a, b) for a, b in zip(m1, m2))  # nor the optimizer state
    assert rows[2]["lr"] == rows[1]["lr"] != rows[0]["lr"]  # the skipped step did not advance the LR schedule
    assert any(not torch.equal(after2[n], after3[n]) for n in after2)  # step 3 did
    assert all(torch.isfinite(p).all() for p in after3.values())
    assert any("step 2: a non-finite loss, log-prob or gradient norm; the update was not applied" in m
               for m in caplog.messages)
    json.dumps(rows, allow_nan=False)  # the step log stays valid JSON


def test_with_mu_2_a_non_finite_second_update_undoes_the_first(tiny_model_dir, tiny_problems, tmp_path,
                                                                 monkeypatch, caplog):
    """mu = 2, and the step's second inner update is found non-finite (the detector made to say
    so on its second call): the first inner update, already applied, is undone, so the step's
    row says what holds: no update, LoRA weights and AdamW state as before the step."""
    trainer, model = _nan_trainer(tiny_model_dir, tiny_problems, tmp_path, monkeypatch, bad_calls=set(), steps=2, optimizer={"mu": 2})
    trainer.train_step()  # a normal step: AdamW has moments
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    moments = [s["exp_avg"].clone() for s in trainer.updater.optimizer.state.values()]
    verdicts = iter([True, False])
    real = trainer.finite_everywhere
    monkeypatch.setattr(trainer, "finite_everywhere", lambda sums: real(sums) and next(verdicts))
    with caplog.at_level("WARNING", logger="grpo.training.trainer"):
        row = trainer.train_step()
    assert row["update_skipped"] == 1
    assert all(torch.equal(p, lora[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, trainer.updater.optimizer.state.values()))
    assert any("step 2: inner update 2 of mu 2 was not applied: the 1 before it are undone" in m for m in caplog.messages)


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_non_finite_steps_in_a_row_stop_training_with_one_line(tiny_model_dir, tiny_problems, tmp_path, monkeypatch):
    """Every step from the third on is infinite: with ``max_nonfinite_steps`` 2 training stops after
    step 4 with one line naming the steps and the last good checkpoint (step 2's)."""
    from grpo.core.errors import StageStop

    trainer, _ = _nan_trainer(tiny_model_dir, tiny_problems, tmp_path, monkeypatch, bad_calls=set(range(3, 10)),
                              steps=6, checkpoints={"every": 2}, guards={"max_nonfinite_steps": 2})
    with pytest.raises(StageStop) as err:
        trainer.train(progress=False)
    line = str(err.value)
    assert "\n" not in line and line.startswith("train: steps 3-4: 2 updates in a row not applied")
    assert line.split("the last good checkpoint: ")[1].startswith(str(tmp_path / "checkpoints" / "step_000002"))
    assert [r.get("update_skipped", 0) for r in trainer.history] == [0, 0, 1, 1]  # logged, then stopped
    assert (tmp_path / "steps.jsonl").read_text().count("update_skipped") == 2


def test_the_engine_gap_guard_warns_then_stops_after_steps_in_a_row(caplog):
    """Rows as the trainer logs them: a gap above the bound warns, one at or below it (or none: the
    decode loop measures none) resets the count, the limit stops with one line naming the steps."""
    from grpo.core.errors import StageStop
    from grpo.training.trainer import EngineGapGuard

    guard = EngineGapGuard(bound=0.1, limit=2)
    with caplog.at_level("WARNING", logger="grpo.training.trainer"):
        for step, gap in enumerate([0.05, 0.3, 0.1, None, 0.2], start=1):
            guard.check({"step": step, "logp_mismatch_mean": gap})
    assert [m.split(":")[0] for m in caplog.messages] == ["step 2", "step 5"] and guard.count == 1
    with pytest.raises(StageStop, match=r"^train: steps 5-6: the engine's log-probs 1.26 nats/token"):
        guard.check({"step": 6, "logp_mismatch_mean": 1.26})


def test_the_validation_interval_counts_a_problem_asked_twice_once():
    """Two wordings of 3 + 4 (one cluster, both right) and 5 + 6 asked once (wrong): 3 rows, 2
    clusters; the interval is the evaluations' (``grpo.algorithm.stats.clustered_interval``) on those keys."""
    from grpo.algorithm.stats import clustered_interval
    from grpo.data.answers import cluster_key
    from grpo.training.trainer import validation_interval

    questions = ["What is 3 + 4?", "Compute 4 + 3.", "What is 5 + 6?"]
    outcomes = [(True, cluster_key(questions[0])), (True, cluster_key(questions[1])), (False, cluster_key(questions[2]))]
    got = validation_interval(outcomes)
    want = clustered_interval([True, True, False], ["3,4", "3,4", "5,6"])
    assert got == {"val_ci_low": want.low, "val_ci_high": want.high, "val_clusters": 2, "val_effective_n": want.effective_n}
    assert validation_interval([]) == {}


def test_the_bar_shows_the_last_validation_measured_so_far():
    from grpo.training.trainer import progress_postfix

    rows = [{"reward_mean": 0.25, "rollout_accuracy": 0.125}]
    assert progress_postfix(rows) == {"reward": "0.250", "acc": "0.125", "val": "-"}
    rows += [{"reward_mean": 0.5, "rollout_accuracy": 0.5, "val_accuracy": 0.375}, {"reward_mean": None, "rollout_accuracy": 0.75}]
    assert progress_postfix(rows) == {"reward": "-", "acc": "0.750", "val": "0.375"}


def test_the_trainer_builds_none_of_its_parts():
    """``GRPOTrainer`` receives its token rule and loss built (``TrainerParts``, every part but the
    backend required): the trainer's module imports none of their builders."""
    import grpo.training.trainer as trainer_mod

    assert not hasattr(trainer_mod, "build_token_rule") and not hasattr(trainer_mod, "build_loss")
    with pytest.raises(TypeError):
        trainer_mod.TrainerParts(backend=None)  # the rule and the loss are required
