"""grpo.training.trainer_builder: a bench's departures from the params (``depart``, ``departure_line``) and
``build_trainer``, the train stage's trainer, on the tiny model (seconds on the CPU)."""

from __future__ import annotations

import pytest
import torch

from grpo.config.params import AllParams, load_params
from grpo.core.errors import ParamsError
from grpo.training.trainer_builder import build_trainer, depart, departure_line

from .helpers import _write_params


def test_depart_replaces_the_keys_named_and_keeps_the_rest():
    params = AllParams()
    before = params.model_dump()
    out = depart(params, {"train.optimizer.mu": 1, "train.steps": 3, "lora.rank": 4})
    assert (out.train.optimizer.mu, out.train.steps, out.lora.rank) == (1, 3, 4)
    expected = {**before, "train": {**before["train"], "steps": 3, "optimizer": {**before["train"]["optimizer"], "mu": 1}},
                "lora": {**before["lora"], "rank": 4}}
    assert out.model_dump() == expected
    assert params.model_dump() == before  # left as it was
    assert depart(params, {}) == params


def test_depart_keeps_the_sections_a_stage_loaded_and_no_others(tmp_path):
    from grpo.config.reading import load_sections
    from grpo.config.sections.train import TrainConfig

    path = tmp_path / "params.yaml"
    path.write_text("train:\n  optimizer:\n    lr: 0.1\n")
    out = depart(load_sections(path, TrainConfig), {"train.optimizer.mu": 3})
    assert (out.train.optimizer.mu, out.train.optimizer.lr) == (3, 0.1)
    with pytest.raises(AttributeError):
        _ = out.model


@pytest.mark.parametrize(("departures", "message"), [
    ({"train.zzz": 1}, "train.zzz: unknown key"),
    ({"train.learning_rate": 1e-4}, "train.learning_rate: unknown key; did you mean train.optimizer.lr?"),
    ({"train.optimizer.mu": 0}, "train.optimizer.mu: must be > 0, got 0"),
    ({"train.optimizer.mu": "x"}, "train.optimizer.mu: must be an integer, got 'x'"),
])
def test_an_unknown_key_or_a_bad_value_is_one_line_naming_it(departures, message):
    with pytest.raises(ParamsError) as err:
        depart(AllParams(), departures)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["trainer.mu", "mu"])
def test_an_unknown_section_is_one_line_naming_it(key):
    with pytest.raises(ParamsError, match=key.split(".")[0]):
        depart(AllParams(), {key: 1})


def test_departure_line_words_each_departure_or_none():
    assert departure_line({"train.optimizer.mu": 1, "train.steps": 3}) == "train.optimizer.mu=1, train.steps=3"
    assert departure_line({"train.loss.entropy_rule": "high"}) == "train.loss.entropy_rule=high"
    assert departure_line({}) == "none"


@pytest.fixture
def tiny_params(tiny_model_dir, tiny_problems, tmp_path):
    """The tiny model's params with the decode loop (no engine), unquantized: a build takes a fraction
    of a second."""
    params = load_params(_write_params(tmp_path, tiny_model_dir, tiny_problems, steps=2))
    return depart(params, {"model.quantization": "none"})


def _lora_a(built) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for n, p in built.model.named_parameters() if "lora_A" in n])


def test_the_trainer_carries_the_departure_and_the_stages_order_of_rng_use(tiny_params, tiny_problems):
    """The trainer's config is the departed params'; LoRA's initial weights are drawn after
    ``train.seed`` is set, so the same seed builds the same policy and another seed another."""
    built = build_trainer(depart(tiny_params, {"train.optimizer.mu": 3}), "cpu", problems=tiny_problems)
    try:
        assert built.trainer.cfg.optimizer.mu == 3 and built.trainer.cfg.steps == tiny_params.train.steps == 2
        assert built.trainer.model is built.model and built.trainer.backend is built.backend
        assert (built.weights_form, built.backend.name, built.closers) == (None, "transformers", [])
        assert built.problems == tiny_problems == built.trainer.problems  # every prompt fits
        again = build_trainer(tiny_params, "cpu", problems=tiny_problems)
        other = build_trainer(depart(tiny_params, {"train.seed": tiny_params.train.seed + 1}), "cpu",
                              problems=tiny_problems)
        assert torch.equal(_lora_a(built), _lora_a(again)) and not torch.equal(_lora_a(built), _lora_a(other))
        again.backend.close()
        other.backend.close()
    finally:
        built.backend.close()


def test_a_prompt_that_does_not_fit_is_left_out_and_the_loggers_are_made_once(tiny_params, tiny_problems):
    long = {"id": "long", "question": "What is " + " + ".join(["1"] * 600) + "?", "answer": "600", "solution": ""}
    made = []

    def loggers():
        made.append(1)
        return [], ["closer"]

    built = build_trainer(tiny_params, "cpu", problems=[*tiny_problems, long], loggers=loggers)
    try:
        assert [p["id"] for p in built.trainer.problems] == [p["id"] for p in tiny_problems]
        assert (made, built.closers) == ([1], ["closer"])
    finally:
        built.backend.close()


def test_the_rule_and_the_loss_are_built_once_and_handed_to_the_passes(tiny_params, tiny_problems, monkeypatch):
    """``build_token_rule`` and ``build_loss`` run once per build; the passes hold those objects, of
    the params' rule, options, clip and T_max."""
    import grpo.training.trainer_builder as builder_mod
    from grpo.algorithm.entropy import TOKEN_RULES

    calls = []
    for name in ("build_token_rule", "build_loss"):
        real = getattr(builder_mod, name)
        monkeypatch.setattr(builder_mod, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    built = build_trainer(tiny_params, "cpu", problems=tiny_problems)
    try:
        passes, loss = built.trainer.passes, tiny_params.train.loss
        assert calls == ["build_token_rule", "build_loss"]
        assert type(passes.rule) is TOKEN_RULES[loss.entropy_rule] and passes.rule.options == loss.rule_options() and passes.rule.clip == loss.clip()
        assert (passes.loss.epsilon, passes.loss.beta, passes.loss.max_length) == (
            loss.clip()[0], loss.beta, tiny_params.train.rollouts.max_new_tokens)
    finally:
        built.backend.close()


def test_a_bench_swaps_one_part_and_the_rest_is_built_as_the_stage_builds_it(tiny_params, tiny_problems):
    """A subclass of ``TrainerBuilder`` overriding ``token_rule`` and ``rollout_lengths`` (a bench's
    departures beyond params): the trainer runs that rule, its backend those lengths, and the policy
    is the stage's (the same seed, the same LoRA weights)."""
    from grpo.algorithm.entropy import KeepHigh, QuantileOptions
    from grpo.training.trainer_builder import TrainerBuilder

    mine = KeepHigh(QuantileOptions(top_quantile=0.5))

    class Bench(TrainerBuilder):
        def token_rule(self):
            return mine

        def rollout_lengths(self):
            return None, 3

    stage, bench = build_trainer(tiny_params, "cpu", problems=tiny_problems), Bench(tiny_params, "cpu").build(tiny_problems)
    try:
        assert bench.trainer.passes.rule is mine and stage.trainer.passes.rule is not mine
        assert bench.backend.min_new_tokens == 3 and stage.backend.min_new_tokens == 0
        assert torch.equal(_lora_a(stage), _lora_a(bench))
    finally:
        stage.backend.close()
        bench.backend.close()
