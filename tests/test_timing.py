"""grpo.tools.timing: the modelled time of each stage on a card, and grpo check's lines."""

from pathlib import Path

import pytest
import yaml

from grpo.config.overlay import overlay_params
from grpo.config.params import AllParams
from grpo.tools import memory
from grpo.tools.timing import CARDS, decode_step_s, format_times, load_reference, stage_seconds, update_s

REPO = Path(__file__).resolve().parents[1]


def seed003(**over) -> AllParams:
    raw = overlay_params(yaml.safe_load((REPO / "params.yaml").read_text()),
                         yaml.safe_load((REPO / "presets/seed003.yaml").read_text()))
    return AllParams.model_validate(overlay_params(raw, over))


@pytest.fixture(scope="module")
def shapes():
    return memory.resolve_shapes(seed003().model, REPO)


def test_the_reference_card_models_its_own_measurements_at_their_shapes(shapes):
    ref = load_reference()
    card = CARDS[ref.card]
    assert decode_step_s(shapes, card, ref.decode_rows, ref.decode_positions, ref) == pytest.approx(ref.decode_step_s)
    assert update_s(shapes, card, ref.update_rows, ref.update_positions, ref.update_mu, ref.update_micro_batches,
                    ref) == pytest.approx(ref.update_s)


def test_a_slower_card_is_never_modelled_faster_and_work_adds_up(shapes):
    p = seed003()
    fast, slow = (stage_seconds(p, shapes, CARDS[n], 128) for n in ("h200", "rtx3060ti"))
    assert all(slow[s].seconds > fast[s].seconds > 0 for s in fast)
    twice = stage_seconds(seed003(train={"steps": 2 * p.train.steps}), shapes, CARDS["h200"], 128)
    assert twice["train"].seconds == pytest.approx(2 * fast["train"].seconds)
    no_val = stage_seconds(seed003(data={"val_size": 0}), shapes, CARDS["h200"], 128)
    assert no_val["train"].seconds < fast["train"].seconds and "0 validations" in no_val["train"].how


def test_grpo_check_prints_each_stage_for_every_card(shapes, capsys):
    from grpo.tools.cli import main

    assert main(["check", "--params", str(REPO / "presets/seed003.yaml"), "--device", "cuda", "--gpu-memory", "7.6"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = format_times(seed003(), shapes, 128)
    start = out.index(lines[0])
    assert [line.split()[0] for line in out[start + 2:start + 6]] == ["sent", "baseline_eval", "final_eval", "train"]
    assert all(name in out[start + 1] for name in CARDS)


def test_fewer_micro_batches_model_a_shorter_update_on_the_launch_bound_card(shapes):
    ref = load_reference()
    card = CARDS[ref.card]
    eight, two = (update_s(shapes, card, 16, 640, 2, mb, ref) for mb in (8, 2))
    assert two < eight / 2
