"""grpo.config.sections: each section's fields and bounds (a bad value names its field in one line), moved keys, and
the train keys other stages read. The messages' wording (did-you-mean, hints): tests/test_messages.py."""

from __future__ import annotations

import pytest

from grpo.config.choices import registry
from grpo.config.params import params_from_dict
from grpo.config.reading import ParamsError
from grpo.config.sections.train import TrainConfig


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"train": {"optimizer": {"lr": 0}}}, "train.optimizer.lr"),
        ({"train": {"optimizer": {"lr": -1e-4}}}, "train.optimizer.lr"),
        ({"train": {"loss": {"entropy_rule_options": {"archer": {"top_quantile": 0.0}}}}},
         "train.loss.entropy_rule_options.archer.top_quantile"),
        ({"train": {"loss": {"entropy_rule_options": {"high": {"top_quantile": 1.5}}}}},
         "train.loss.entropy_rule_options.high.top_quantile"),
        ({"train": {"rollouts": {"group_size": 1}}}, "train.rollouts.group_size"),
        ({"train": {"loss": {"entropy_rule": "low", "entropy_rule_options": {"low": {"top_quantile": 1.0}}}}}, "train.loss.entropy_rule"),
        ({"train": {"loss": {"entropy_rule": "middle"}}}, "train.loss.entropy_rule"),
        ({"train": {"loss": {"policy_loss": "ppo"}}}, "train.loss.policy_loss"),
        ({"train": {"order": "backwards"}}, "train.order"),
        ({"train": {"rewards": {"correctnes": 1.0}}}, "train.rewards"),
        ({"train": {"loss": {"loss_type": "ppo"}}}, "train.loss.loss_type"),
        ({"train": {"steps": "ten"}}, "train.steps"),
        ({"train": {"learning_rate": 1e-4}}, "train.learning_rate"),
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules"),
        ({"model": {"quantization": "int3"}}, "model.quantization"),
        ({"trainer": {}}, "trainer"),
        ({"train": {"optimizer": {"lr": "5e-4"}}}, "train.optimizer.lr"),
        ({"train": {"steps": True}}, "train.steps"),
        ({"data": {"source": "jsonl"}}, "data.path"),
        ({"data": {"operators": ["+", "^"]}}, "data.operators"),
        ({"sent": {"gpu_memory_utilization": 1.5}}, "sent.gpu_memory_utilization"),
        ({"train": {"rollouts": {"engine_weights": "nf4"}}, "model": {"quantization": "none"}}, "train.rollouts.engine_weights"),
    ],
)
def test_bad_values_name_the_field(raw, field):
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    message = str(err.value)
    assert message.startswith(field)
    assert "\n" not in message


def test_the_shared_train_keys_are_the_train_sections_own_and_other_stages_read_only_them():
    """``TrainConfig`` inherits the keys every stage reads (one home for their defaults); a stage
    other than train reads the train section through ``OtherStagesTrainKeys``, which validates those and
    leaves the rest to the train stage."""
    from grpo.config.sections.shared import OtherStagesTrainKeys, SharedTrainKeys

    own = TrainConfig()
    for name in SharedTrainKeys.model_fields:
        assert getattr(own, name) == getattr(SharedTrainKeys(), name), name
    seen = OtherStagesTrainKeys(**{**own.model_dump(), "optimizer": {"lr": -1.0}, "zzz": 1, "metrics_dir": "elsewhere"})
    assert seen.model_dump() == {**SharedTrainKeys().model_dump(), "metrics_dir": "elsewhere"}
    with pytest.raises(ParamsError, match=r"^train\.system_prompt: must be a string"):
        OtherStagesTrainKeys(system_prompt=3)


def test_every_section_is_named_in_the_list_the_stages_check_files_against():
    from grpo.config.params import SECTIONS
    from grpo.config.reading import SECTION_NAMES

    assert tuple(SECTIONS) == SECTION_NAMES
    assert all(cls.SECTION == name for name, cls in SECTIONS.items())


def with_options(param: str) -> str:
    """The entries of ``param``'s registry that have options, as the refusal lists them (a new
    entry with options joins the list with no edit here)."""
    return ", ".join(registry(param).with_options())


@pytest.mark.parametrize(("raw", "message"), [
    ({"train": {"entropy_kl_low": 0.3}}, "train.entropy_kl_low: moved to train.loss.entropy_rule_options.sent_kl.kl_low "
                                         "(and .archer.kl_low)"),
    ({"train": {"entropy_clip_high": 0.4}}, "train.entropy_clip_high: moved to train.loss.entropy_rule_options.archer.clip_high"),
    ({"train": {"num_stages": 2}}, "train.num_stages: moved to train.order_options.curriculum.num_stages (and "
                                   ".reversed.num_stages)"),
    ({"train": {"order_options": {"shuffled": {"num_stages": 2}}}},
     f"train.order_options.shuffled: no order of that name has options; those that do: {with_options('train.order')}"),
    ({"train": {"loss": {"entropy_rule_options": {"high": {"kl_low": 0.1}}}}},
     "train.loss.entropy_rule_options.high.kl_low: unknown key; train.loss.entropy_rule_options.high has no key like it "
     "(1 keys: docs/configuration.md)"),
    ({"train": {"mu": 2}}, "train.mu: moved to train.optimizer.mu"),
    ({"train": {"loss": {"epsilon": 0.1}}}, "train.loss.epsilon: moved to train.loss.policy_loss_options.clipped.epsilon"),
    ({"train": {"entropy_top_quantile": 1.0}},
     "train.entropy_top_quantile: moved to train.loss.entropy_rule_options.<rule>.top_quantile (each rule's own)"),
    ({"train": {"loss": {"entropy_rule_options": {"archer": {"kl_low": -1.0}}}}},
     "train.loss.entropy_rule_options.archer.kl_low: must be >= 0, got -1.0"),
    ({"train": {"loss": {"entropy_rule_options": {"archer": {"clip": 0.4}}}}},
     "train.loss.entropy_rule_options.archer.clip: unknown key; did you mean train.loss.entropy_rule_options.archer.clip_high?"),
    ({"train": {"order_options": {"curriculum": {"num_stages": 0}}}},
     "train.order_options.curriculum.num_stages: must be > 0, got 0"),
    ({"decode": {"check_every": 8}}, "decode.check_every: moved to decode.loop_options.static.check_every"),
    ({"decode": {"check_every": 8, "length_bucket": 32}}, "decode.check_every: moved to decode.loop_options.static.check_every; "
                                                          "decode.length_bucket: moved to decode.loop_options.static.length_bucket"),
    ({"decode": {"loop_options": {"dynamic": {}}}},
     f"decode.loop_options.dynamic: no decode loop of that name has options; those that do: {with_options('decode.loop')}"),
    ({"decode": {"loop_options": {"static": {"check_every": 0}}}},
     "decode.loop_options.static.check_every: must be > 0, got 0"),
])
def test_an_entrys_options_live_under_its_name_and_a_moved_key_says_where(raw, message):
    """Each registered entry validates its own options (its ``Options`` model); an old params file's
    key that moved gets one line naming its new place."""
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    assert str(err.value) == message


def test_an_entry_left_out_of_its_options_takes_its_own_defaults():
    from grpo.algorithm.curriculum import CurriculumOptions
    from grpo.algorithm.entropy import ArcherOptions, LowOptions, QuantileOptions, SentKLOptions

    cfg = TrainConfig(order_options={"curriculum": {"num_stages": 2}}, loss={"entropy_rule_options": {"sent_kl": {"kl_low": 0.3}}})
    assert cfg.loss.entropy_rule_options == {"high": QuantileOptions(), "low": LowOptions(), "archer": ArcherOptions(),
                                             "sent_kl": SentKLOptions(kl_low=0.3)}
    assert cfg.order_options["curriculum"] == CurriculumOptions(num_stages=2)
    assert cfg.order_options["reversed"].num_stages == CurriculumOptions().num_stages
    assert TrainConfig().model_dump()["loss"]["entropy_rule_options"] == {
        "high": QuantileOptions().model_dump(), "low": LowOptions().model_dump(), "archer": ArcherOptions().model_dump(),
        "sent_kl": SentKLOptions().model_dump()}


def _levels(cls, name: str) -> dict[str, int]:
    """Field counts of ``cls`` and of every part (a nested section) under it, by dotted name."""
    from pydantic import BaseModel

    out = {name: len(cls.model_fields)}
    for field, info in cls.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out.update(_levels(sub, f"{name}.{field}"))
    return out


def test_no_level_of_the_train_section_has_more_than_twenty_keys():
    counts = _levels(TrainConfig, "train")
    assert len(counts) == 9 and max(counts.values()) <= 20, counts


def test_an_old_flat_train_section_is_answered_key_by_key():
    """Every key the flat train section had (issue 59's list, at its last flat commit) is either
    still a top-level key or one line naming its new place, and the place named exists."""
    from grpo.config.sections.train_parts import MOVED

    flat = ("data_path order order_options output_dir adapter_dir seed deterministic steps prompts_per_step "
            "group_size max_new_tokens rollout_backend max_num_batched_tokens engine_weights "
            "importance_sampling_correction importance_sampling_cap temperature top_p mu micro_batches "
            "generation_batch_size shared_prompt_forward forward_layout release_generation_memory lr weight_decay "
            "warmup_steps lr_schedule max_grad_norm epsilon epsilon_high beta loss_type policy_loss advantage_scale "
            "entropy_top_quantile entropy_rule entropy_rule_options kernel logprob_chunk checkpoint_every val_path "
            "eval_every eval_max_new_tokens max_logp_gap max_logp_gap_steps max_nonfinite_steps keep_best rewards "
            "truncated wandb_mode wandb_project num_processes dist_timeout_s deepspeed_config gpu_memory_utilization "
            "max_model_len metrics_dir system_prompt").split()
    default = TrainConfig()
    for key in flat:
        if key in TrainConfig.model_fields:
            continue
        with pytest.raises(ParamsError) as err:
            TrainConfig(**{key: 1})
        assert str(err.value) == f"train.{key}: moved to {MOVED[key]}"
        node = default
        for part in MOVED[key].split(" ")[0].split(".")[1:]:  # the place named is a key of today's section
            part = "archer" if part == "<rule>" else part
            node = node[part] if isinstance(node, dict) else getattr(node, part)


def test_an_old_params_file_gets_every_moved_key_in_one_message():
    """A whole flat train section: one error that names the new place of each of its moved keys
    (the user migrates the file in one pass, not one key a run)."""
    from grpo.config.sections.train_parts import MOVED

    old = {key: 1 for key in MOVED}
    with pytest.raises(ParamsError) as err:
        TrainConfig(**old)
    clauses = str(err.value).split("; ")
    assert "\n" not in str(err.value)
    assert sorted(clauses) == sorted(f"train.{key}: moved to {MOVED[key]}" for key in old)
