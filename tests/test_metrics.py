"""The step's statistics (``grpo.training.metrics``) on hand-worked values: how each declared statistic adds up
over micro-batches, over the ``mu`` updates and into the step row; the phase timer's keys; the reward
statistics of a whole step."""

from __future__ import annotations

import math
import time

import pytest
import torch

from grpo.core.distributed import Dist
from grpo.training.metrics import (
    OWN,
    STATS,
    TIMES,
    UPDATE,
    PhaseTimer,
    Sums,
    over_mu,
    reduce_over_ranks,
    reward_stats,
    update_row,
)


def test_every_statistic_is_declared_once_and_shown_under_its_own_key():
    """One ``Stat`` per name; the update's statistics each reach the row under a distinct key that
    no time or count takes."""
    names = [s.name for s in UPDATE]
    assert len(names) == len(set(names)) and set(names) <= set(STATS)
    keys = [s.key for s in UPDATE if s.key is not None]
    assert len(keys) == len(set(keys))
    assert {s.name for s in UPDATE if s.key is None} == {  # inputs of kl_grad_share and of rule_action_row
        "policy_grad_sq", "kl_grad_sq", "policy_grad_abs", "kept_grad", "wide_tokens", "band_tokens", "band_grad",
        "acting_tokens", "clipped_acting", "wide_acting", "band_acting", "zero_adv_rows"}
    assert not set(keys) & set(TIMES) and not set(keys) & set(OWN)
    assert STATS["entropy"].key == "entropy_mean" and STATS["loss"].key == "loss"
    assert all(STATS[n].key is None for n in ("n_valid", "n_rows", "n_valid_step", "n_rows_step"))


def test_add_sums_a_sum_statistic_and_keeps_the_largest_of_a_max_one():
    sums = Sums()
    for value in (0.5, 0.25, 0.125):
        sums.add("loss", value)  # reduce: sum
    for value in (0.3, 0.1, 0.7, 0.2):
        sums.add("mismatch_max", value)  # reduce: max
    assert sums["loss"] == 0.875 and sums["mismatch_max"] == 0.7
    assert "kl" not in sums.values  # never added: absent, not 0
    with pytest.raises(KeyError):
        sums["kl"]


def test_a_micro_batch_adds_its_declared_statistics_token_means_weighted_by_its_tokens():
    """Two micro-batches of 4 and 2 valid tokens: ``kl`` (a token mean) adds 0.5 x 4 + 0.25 x 2 = 2.5;
    ``loss`` and ``entropy`` (sums already) add as they are; ``mismatch_max`` keeps the larger; keys
    not declared in ``UPDATE`` (a count, a typo) are ignored; a statistic not reported stays absent."""
    sums = Sums()
    sums.add_micro_batch({"kl": 0.5, "loss": 0.2, "entropy": 3.0, "mismatch_max": 0.4, "n_valid": 99.0,
                          "bogus": 9.0}, n_tokens=4.0)
    sums.add_micro_batch({"kl": 0.25, "loss": 0.1, "entropy": 1.0, "mismatch_max": 0.3}, n_tokens=2.0)
    assert sums.values == pytest.approx({"kl": 2.5, "loss": 0.3, "entropy": 4.0, "mismatch_max": 0.4})


def test_the_timer_adds_each_phases_seconds_under_its_declared_key():
    """A phase adds the block's wall time (nested phases each theirs, a phase run twice both times,
    a block that raises still counted); ``add`` adds a measured time; a key outside ``TIMES`` and
    ``OWN`` raises a KeyError naming it."""
    timer = PhaseTimer()
    t0 = time.perf_counter()
    with timer.phase("step_time_s"):
        with timer.phase("time_generate_s"):
            time.sleep(0.02)
        for _ in range(2):
            with timer.phase("time_update_s"):
                time.sleep(0.01)
    outer = time.perf_counter() - t0
    times = timer.times
    assert set(times) == {"step_time_s", "time_generate_s", "time_update_s"}
    assert times["time_generate_s"] >= 0.02 and times["time_update_s"] >= 0.02
    assert times["time_generate_s"] + times["time_update_s"] <= times["step_time_s"] <= outer
    with pytest.raises(RuntimeError, match="in the block"):
        with timer.phase("time_logprob_s"):
            raise RuntimeError("in the block")
    assert times["time_logprob_s"] >= 0
    timer.add("time_wait_s", 0.5)
    timer.add("time_wait_s", 0.25)
    assert times["time_wait_s"] == 0.75
    with pytest.raises(KeyError, match="time_bogus_s"):
        timer.add("time_bogus_s", 1.0)
    with pytest.raises(KeyError, match="time_other_s"):
        with timer.phase("time_other_s"):
            pass
    assert "time_bogus_s" not in times and "time_other_s" not in times


def test_over_mu_averages_the_updates_except_the_gap_taken_before_the_first():
    """``mu = 2``: the loss and the kept count are the mean of the two updates; the engine gap
    (``over_mu="first"``) is the first update's, measured before any update moved the policy."""
    first = Sums({"loss": 1.0, "kept": 6.0, "mismatch_sum": 2.0, "mismatch_max": 0.5})
    second = Sums({"loss": 3.0, "kept": 4.0, "mismatch_sum": 6.0, "mismatch_max": 0.9})
    assert over_mu([first, second]) == pytest.approx(
        {"loss": 2.0, "kept": 5.0, "mismatch_sum": 2.0, "mismatch_max": 0.5})
    assert over_mu([first]) == first.values


def test_reduce_over_ranks_with_one_process_keeps_values_and_order():
    values = {"time_update_s": 1.5, "loss": 0.25, "mismatch_max": 0.5}
    ops = {"time_update_s": "max", "loss": "sum", "mismatch_max": "max"}
    out = reduce_over_ranks(Dist(), values, ops, torch.device("cpu"))
    assert out == values and list(out) == list(values)


def test_update_row_divides_token_sums_by_the_updates_tokens():
    """One process: the update back-propagated 2 of the step's 4 completions, 4 of its 10 valid
    tokens. Per-token statistics are divided by the update's 4 tokens, the loss and the largest gap
    are shown as they are, the counts are not shown; completion_len is the step's 10 / 4 tokens,
    update_frac 2 / 4; the times come through, each under its key."""
    sums = {"loss": 0.6, "kl": 2.0, "entropy": 8.0, "kept": 2.0, "mismatch_sum": 0.2, "mismatch_max": 0.1,
            "is_weight_sum": 3.6, "n_valid": 4.0, "n_rows": 2.0, "n_valid_step": 10.0, "n_rows_step": 4.0}
    times = {"step_time_s": 2.0, "time_update_s": 1.5, "time_wait_s": 0.1, "time_allreduce_s": 0.05}
    row = update_row(Dist(), sums, times, torch.device("cpu"))
    assert row == pytest.approx({
        "loss": 0.6, "kl": 0.5, "entropy_mean": 2.0, "kept_frac": 0.5, "logp_mismatch_mean": 0.05,
        "logp_mismatch_max": 0.1, "is_weight_mean": 0.9, "completion_len": 2.5, "update_frac": 0.5,
        "step_time_s": 2.0, "time_update_s": 1.5, "time_wait_s": 0.1, "time_allreduce_s": 0.05})


def test_the_kl_share_is_the_root_of_the_summed_squared_norms_and_the_inputs_are_not_shown():
    """Two micro-batches' squared norms add (they touch different log-probs): 0.01 + 0.03 over 1 + 3."""
    sums = Sums()
    for pol, kl in ((1.0, 0.01), (3.0, 0.03)):
        sums.add_micro_batch({"policy_grad_sq": pol, "kl_grad_sq": kl}, n_tokens=5.0)
    base = {"n_valid": 4.0, "n_rows": 2.0, "n_valid_step": 4.0, "n_rows_step": 2.0}
    row = update_row(Dist(), {**sums.values, **base}, {}, torch.device("cpu"))
    assert row["kl_grad_share"] == pytest.approx(0.1)
    assert "policy_grad_sq" not in row and "kl_grad_sq" not in row and None not in row


def test_update_row_of_an_update_without_valid_tokens_is_finite():
    """A rank whose update rows are all masked out (no valid token): the per-token statistics are
    divided by 1, not 0."""
    sums = {"loss": 0.0, "entropy": 0.0, "kept": 0.0, "n_valid": 0.0, "n_rows": 0.0, "n_valid_step": 6.0,
            "n_rows_step": 2.0}
    row = update_row(Dist(), sums, {}, torch.device("cpu"))
    assert row == {"loss": 0.0, "entropy_mean": 0.0, "kept_frac": 0.0, "completion_len": 3.0, "update_frac": 0.0}


def test_reward_statistics_of_a_step_by_hand():
    """Three groups of two: (1, 0), (1, 1), (0.5, 0.5). Mean 4/6; ``reward_std`` is torch's
    (Bessel-corrected): the squared deviations sum to 5/6, / 5 -> sqrt(1/6); each reward function's
    mean and std (numpy's, over N) come from its own scores; accuracy is correctness's mean; two of
    the three groups have no spread."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    parts = {"correctness": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], "format_soft": [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]}
    stats = reward_stats(rewards, parts, group_size=2)
    assert stats == pytest.approx({
        "reward_mean": 4 / 6, "reward_std": math.sqrt(1 / 6), "rollout_accuracy": 0.5,
        "reward_correctness_mean": 0.5, "reward_format_soft_mean": 1 / 3,
        "reward_correctness_std": 0.5, "reward_format_soft_std": math.sqrt(2 / 9),
        "zero_std_frac": 2 / 3}, rel=1e-6)


def test_where_the_rule_acted_is_shown_as_shares_of_summed_micro_batches():
    """Two micro-batches: |dL/dlogp| 0.3 + 0.1 in all, 0.1 + 0.0 at kept tokens, 0.05 + 0.05 in the
    band; 6 + 4 wider-clip tokens of which 1 + 1 in the band: shares 0.25, 0.25, 0.2."""
    sums = Sums()
    for part in ({"policy_grad_abs": 0.3, "kept_grad": 0.1, "wide_tokens": 6.0, "band_tokens": 1.0, "band_grad": 0.05},
                 {"policy_grad_abs": 0.1, "kept_grad": 0.0, "wide_tokens": 4.0, "band_tokens": 1.0, "band_grad": 0.05}):
        sums.add_micro_batch(part, n_tokens=7.0)
    base = {"n_valid": 4.0, "n_rows": 2.0, "n_valid_step": 4.0, "n_rows_step": 2.0}
    row = update_row(Dist(), {**sums.values, **base}, {}, torch.device("cpu"))
    total = 0.3 + 0.1
    assert row["kept_grad_share"] == pytest.approx(0.1 / total)
    assert row["wide_band_grad_share"] == pytest.approx(0.1 / total)
    assert row["wide_band_frac"] == pytest.approx(2.0 / 10.0)
    assert not {"policy_grad_abs", "kept_grad", "wide_tokens", "band_tokens", "band_grad"} & set(row)


def test_a_share_without_its_denominator_is_left_out():
    from grpo.training.metrics import rule_action_row

    assert rule_action_row({"policy_grad_abs": 0.0, "kept_grad": 0.0, "wide_tokens": 0.0, "band_tokens": 0.0,
                            "band_grad": 0.0}) == {}
    assert set(rule_action_row({"policy_grad_abs": 2.0})) == set()  # every-token: nothing to share out
