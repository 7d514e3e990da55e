"""grpo.sections: each section's fields and bounds (a bad value names its field in one line), moved keys, and
the train keys other stages read. The messages' wording (did-you-mean, hints): tests/test_messages.py."""

from __future__ import annotations

import pytest

from grpo.config import ParamsError
from grpo.params import params_from_dict
from grpo.sections.train import TrainConfig


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"train": {"lr": 0}}, "train.lr"),
        ({"train": {"lr": -1e-4}}, "train.lr"),
        ({"train": {"entropy_top_quantile": 0.0}}, "train.entropy_top_quantile"),
        ({"train": {"entropy_top_quantile": 1.5}}, "train.entropy_top_quantile"),
        ({"train": {"group_size": 1}}, "train.group_size"),
        ({"train": {"entropy_rule": "low", "entropy_top_quantile": 1.0}}, "train.entropy_rule"),
        ({"train": {"entropy_rule": "middle"}}, "train.entropy_rule"),
        ({"train": {"policy_loss": "ppo"}}, "train.policy_loss"),
        ({"train": {"order": "backwards"}}, "train.order"),
        ({"train": {"rewards": {"correctnes": 1.0}}}, "train.rewards"),
        ({"train": {"loss_type": "ppo"}}, "train.loss_type"),
        ({"train": {"steps": "ten"}}, "train.steps"),
        ({"train": {"learning_rate": 1e-4}}, "train.learning_rate"),
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules"),
        ({"model": {"quantization": "int3"}}, "model.quantization"),
        ({"trainer": {}}, "trainer"),
        ({"train": {"lr": "5e-4"}}, "train.lr"),
        ({"train": {"steps": True}}, "train.steps"),
        ({"data": {"source": "jsonl"}}, "data.path"),
        ({"data": {"operators": ["+", "^"]}}, "data.operators"),
        ({"sent": {"gpu_memory_utilization": 1.5}}, "sent.gpu_memory_utilization"),
        ({"train": {"engine_weights": "nf4"}, "model": {"quantization": "none"}}, "train.engine_weights"),
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
    other than train reads the train section through ``TrainSharedKeys``, which validates those and
    leaves the rest to the train stage."""
    from grpo.sections.shared import SharedTrainKeys, TrainSharedKeys

    own = TrainConfig()
    for name in SharedTrainKeys.model_fields:
        assert getattr(own, name) == getattr(SharedTrainKeys(), name), name
    seen = TrainSharedKeys(**{**own.model_dump(), "lr": -1.0, "zzz": 1, "metrics_dir": "elsewhere"})
    assert seen.model_dump() == {**SharedTrainKeys().model_dump(), "metrics_dir": "elsewhere"}
    with pytest.raises(ParamsError, match=r"^train\.system_prompt: must be a string"):
        TrainSharedKeys(system_prompt=3)


def test_every_section_is_named_in_the_list_the_stages_check_files_against():
    from grpo.config import SECTION_NAMES
    from grpo.params import SECTIONS

    assert tuple(SECTIONS) == SECTION_NAMES
    assert all(cls.SECTION == name for name, cls in SECTIONS.items())


@pytest.mark.parametrize(("raw", "message"), [
    ({"train": {"entropy_kl_low": 0.3}}, "train.entropy_kl_low: moved to train.entropy_rule_options.sent_kl.kl_low "
                                         "(and .archer.kl_low)"),
    ({"train": {"entropy_clip_high": 0.4}}, "train.entropy_clip_high: moved to train.entropy_rule_options.archer.clip_high"),
    ({"train": {"num_stages": 2}}, "train.num_stages: moved to train.order_options.curriculum.num_stages (and "
                                   ".reversed.num_stages)"),
    ({"train": {"entropy_rule_options": {"high": {"kl_low": 0.1}}}},
     "train.entropy_rule_options.high: no token-entropy rule of that name has options; those that do: archer, sent_kl"),
    ({"train": {"entropy_rule_options": {"archer": {"kl_low": -1.0}}}},
     "train.entropy_rule_options.archer.kl_low: must be >= 0, got -1.0"),
    ({"train": {"entropy_rule_options": {"archer": {"clip": 0.4}}}},
     "train.entropy_rule_options.archer.clip: unknown key; did you mean train.entropy_rule_options.archer.clip_high?"),
    ({"train": {"order_options": {"curriculum": {"num_stages": 0}}}},
     "train.order_options.curriculum.num_stages: must be > 0, got 0"),
])
def test_an_entrys_options_live_under_its_name_and_a_moved_key_says_where(raw, message):
    """Each registered entry validates its own options (its ``Options`` model); an old params file's
    key that moved gets one line naming its new place."""
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    assert str(err.value) == message


def test_an_entry_left_out_of_its_options_takes_its_own_defaults():
    from grpo.curriculum import CurriculumOptions
    from grpo.entropy import ArcherOptions, SentKLOptions

    cfg = TrainConfig(entropy_rule_options={"sent_kl": {"kl_low": 0.3}}, order_options={"curriculum": {"num_stages": 2}})
    assert cfg.entropy_rule_options == {"archer": ArcherOptions(), "sent_kl": SentKLOptions(kl_low=0.3)}
    assert cfg.order_options["curriculum"] == CurriculumOptions(num_stages=2)
    assert cfg.order_options["reversed"].num_stages == CurriculumOptions().num_stages
    assert TrainConfig().model_dump()["entropy_rule_options"] == {"archer": ArcherOptions().model_dump(),
                                                                  "sent_kl": SentKLOptions().model_dump()}
