"""The statistics one training step logs, each declared once with how it combines.

A statistic of the update (``UPDATE``) is accumulated over the micro-batches of one update
(``Sums.add``: a sum, or a max), combined over the ``mu`` updates of a step (their mean, or the
first update's value: the sampler/trainer gap is measured before any update moves the policy),
reduced over the data-parallel ranks with the same operation (``reduce_over_ranks``: one
all-reduce per operation) and shown in the step row, divided by the update's valid-token count
when it is a token-weighted sum (the update runs over the step's groups with signal only:
``GRPOTrainer.update_rows``). Times and memory (``TIMES``) are the largest rank's; the two waiting times of the gradient all-reduce are each rank's own. The reward statistics come from
the rewards of the whole step, which every rank already holds (``reward_stats``).

The passes hand each micro-batch's values to ``Sums.add_micro_batch`` in one call, which keeps
the declared ones (a token mean is weighted by the micro-batch's tokens first); the trainer times
its phases with ``PhaseTimer``, whose keys are the declared ``TIMES`` and ``OWN``. A new statistic
is one ``Stat`` line here and its value in the dict where it is computed (``grpo_loss``'s
statistics, ``PolicyPasses.engine_gap``, or the micro-batch's values in ``accumulate_gradients``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from grpo.core.distributed import Dist


@dataclass(frozen=True)
class Stat:
    name: str
    """The accumulator's key (the row's key unless ``row`` says otherwise)."""
    reduce: Literal["sum", "max"] = "sum"
    """Over micro-batches and over ranks."""
    per_token: bool = False
    """Shown divided by the update's valid completion tokens (a token-weighted sum)."""
    over_mu: Literal["mean", "first"] = "mean"
    """Over the ``mu`` updates of one step."""
    row: str | None = ""
    """The key in the step row; ``""``: ``name``; ``None``: not shown (an input of other statistics)."""
    token_mean: bool = False
    """The micro-batch reports a mean over its valid tokens (``grpo_loss``'s statistics): weighted
    by those tokens when added, so the sum is token-weighted."""

    @property
    def key(self) -> str | None:
        return self.name if self.row == "" else self.row


UPDATE = (
    Stat("loss"),  # the step's loss: each micro-batch's is already divided by the step-wide normaliser
    Stat("kl", per_token=True, token_mean=True),  # k3 estimate against the reference policy
    Stat("clip_frac", per_token=True, token_mean=True),  # tokens whose ratio was clipped
    # the two terms' squared gradient norms at the token log-probs (grpo.algorithm.loss.term_grad_norms): kl_grad_share
    Stat("policy_grad_sq", row=None), Stat("kl_grad_sq", row=None),
    Stat("ratio", per_token=True, token_mean=True),  # pi / pi_old
    Stat("entropy", per_token=True, row="entropy_mean"),
    Stat("kept", per_token=True, row="kept_frac"),  # tokens the entropy mask kept
    # with engine rollouts only: the engine's log-probs of the sampled tokens against the trainer's
    Stat("mismatch_sum", per_token=True, over_mu="first", row="logp_mismatch_mean"),
    Stat("mismatch_max", reduce="max", over_mu="first", row="logp_mismatch_max"),
    Stat("is_weight_sum", per_token=True, over_mu="first", row="is_weight_mean"),  # truncated IS weights
    # where the token-entropy rule acted (grpo.training.passes.PolicyPasses.rule_action): the policy term's summed
    # |dL/dlogp| over every valid token, and its part at the kept tokens (a rule that drops tokens):
    # kept_grad_share; archer's wider-clip tokens, those in the band plain PPO clips and the rule does
    # not, and their part of the gradient: wide_band_frac, wide_band_grad_share
    Stat("policy_grad_abs", row=None), Stat("kept_grad", row=None),
    Stat("wide_tokens", row=None), Stat("band_tokens", row=None), Stat("band_grad", row=None),
    # the same where a clip can act (grpo.training.passes.PolicyPasses.rule_action): tokens of rows with a nonzero
    # advantage in the updates after the first; those the clip binds, archer's wider-clip tokens among them and
    # those in its band: clip_frac_acting, wide_band_frac_acting; and the update's rows of zero advantage
    Stat("acting_tokens", row=None), Stat("clipped_acting", row=None), Stat("wide_acting", row=None),
    Stat("band_acting", row=None), Stat("zero_adv_rows", row=None),
)
COUNTS = (  # completion tokens and completions: of the update (the per-token denominator) and of the whole step
    Stat("n_valid", row=None), Stat("n_rows", row=None), Stat("n_valid_step", row=None), Stat("n_rows_step", row=None))
TIMES = ("time_generate_s", "time_logprob_s", "time_update_s", "time_optimizer_s", "step_time_s", "peak_mem_mb",
         "peak_reserved_mb")  # the largest rank's (peak_reserved_mb: CUDA only)
OWN = ("time_wait_s", "time_allreduce_s")  # this rank's wait before the gradient all-reduce and the all-reduce
STATS = {s.name: s for s in (*UPDATE, *COUNTS)}


class Sums:
    """Statistics accumulated as declared in ``STATS`` (a statistic never added is absent)."""

    def __init__(self, values: dict[str, float] | None = None):
        self.values = dict(values or {})

    def add(self, name: str, value: float) -> None:
        if name not in self.values:
            self.values[name] = float(value)
        elif STATS[name].reduce == "max":
            self.values[name] = max(self.values[name], float(value))
        else:
            self.values[name] += float(value)

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def add_micro_batch(self, values: dict[str, float], n_tokens: float) -> None:
        """Add one micro-batch's values of the declared ``UPDATE`` statistics (others are ignored;
        a statistic not reported is not added), token means weighted by its ``n_tokens``."""
        for stat in UPDATE:
            if stat.name in values:
                self.add(stat.name, values[stat.name] * n_tokens if stat.token_mean else values[stat.name])


class PhaseTimer:
    """Wall times of a step's phases under their declared keys (``TIMES``, ``OWN``):
    ``with timer.phase("time_generate_s"): ...`` adds the block's seconds; ``add`` a measured one."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t0)

    def add(self, key: str, seconds: float) -> None:
        if key not in TIMES and key not in OWN:
            raise KeyError(f"{key}: not a declared time (grpo.training.metrics.TIMES, OWN)")
        self.times[key] = self.times.get(key, 0.0) + seconds


def over_mu(updates: list[Sums]) -> dict[str, float]:
    """The step's statistics from those of its ``mu`` updates (each ``Stat.over_mu``)."""
    out = {}
    mu = len(updates)
    for i, sums in enumerate(updates):
        for name, value in sums.values.items():
            if STATS[name].over_mu == "mean":
                out[name] = out.get(name, 0.0) + value / mu
            elif i == 0:
                out[name] = value
    return out


def reduce_over_ranks(dist: Dist, values: dict[str, float], ops: dict[str, str], device) -> dict[str, float]:
    """``values`` reduced over ranks, each with its op in ``ops`` (``sum`` / ``max``): one
    all-reduce per op, in a sorted key order every rank shares."""
    out = {}
    for op in ("sum", "max"):
        keys = sorted(k for k in values if ops[k] == op)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
        out.update(zip(keys, dist.all_reduce(t, op).tolist()))
    return {k: out[k] for k in values}


def update_row(dist: Dist, sums: dict[str, float], times: dict[str, float], device) -> dict[str, float]:
    """The update's part of the step row: ``sums`` (this rank's, with ``n_valid`` and ``n_rows``)
    and ``times`` (``TIMES`` keys and ``OWN`` keys) reduced over ranks and shown as declared."""
    shared = {k: v for k, v in times.items() if k not in OWN}
    ops = {**{k: STATS[k].reduce for k in sums}, **dict.fromkeys(shared, "max")}
    reduced = reduce_over_ranks(dist, {**sums, **shared}, ops, device)
    n_valid = max(1.0, reduced["n_valid"])
    row = {}
    for stat in UPDATE:
        if stat.name in reduced and stat.key is not None:
            row[stat.key] = reduced[stat.name] / n_valid if stat.per_token else reduced[stat.name]
    if reduced.get("policy_grad_sq"):  # a KL term ran: its gradient's norm over the policy term's
        row["kl_grad_share"] = math.sqrt(reduced["kl_grad_sq"] / reduced["policy_grad_sq"])
    row.update(rule_action_row(reduced))
    row["completion_len"] = reduced["n_valid_step"] / reduced["n_rows_step"]
    row["update_frac"] = reduced["n_rows"] / reduced["n_rows_step"]  # completions the update back-propagated
    if "zero_adv_rows" in reduced and reduced["n_rows"] > 0:  # of them, those of zero advantage (equal rewards)
        row["zero_adv_update_frac"] = reduced["zero_adv_rows"] / reduced["n_rows"]
    return {**row, **{k: reduced[k] for k in shared}, **{k: times[k] for k in OWN if k in times}}


def rule_action_row(reduced: dict[str, float]) -> dict[str, float]:
    """The step row's shares of where the token-entropy rule acted, from the reduced sums: the
    kept tokens' share of the policy gradient's magnitude (``kept_grad_share``, a rule that drops
    tokens), the fraction of the wider-clip tokens in the band beyond the ordinary clip
    (``wide_band_frac``) and their share of the gradient (``wide_band_grad_share``, archer); the same
    two fractions over the tokens where a clip can act (``clip_frac_acting``, ``wide_band_frac_acting``:
    rows of nonzero advantage, updates after the first). A share whose denominator is 0 (no
    gradient, no wider-clip token, no token that can act) is left out."""
    row, grad = {}, reduced.get("policy_grad_abs", 0.0)
    if grad > 0 and "kept_grad" in reduced:
        row["kept_grad_share"] = reduced["kept_grad"] / grad
    if grad > 0 and "band_grad" in reduced:
        row["wide_band_grad_share"] = reduced["band_grad"] / grad
    if reduced.get("wide_tokens", 0.0) > 0:
        row["wide_band_frac"] = reduced["band_tokens"] / reduced["wide_tokens"]
    if reduced.get("acting_tokens", 0.0) > 0:
        row["clip_frac_acting"] = reduced["clipped_acting"] / reduced["acting_tokens"]
    if reduced.get("wide_acting", 0.0) > 0:
        row["wide_band_frac_acting"] = reduced["band_acting"] / reduced["wide_acting"]
    return row


def reward_stats(rewards: torch.Tensor, parts: dict[str, list[float]], group_size: int) -> dict[str, float]:
    """Statistics of the whole step's (N,) total rewards and each reward function's (N,) scores
    (``correctness`` among them: the row's ``accuracy``)."""
    grouped = rewards.view(-1, group_size)  # (prompts, G)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "rollout_accuracy": float(np.mean(parts["correctness"])),
        **{f"reward_{k}_mean": float(np.mean(v)) for k, v in parts.items()},
        **{f"reward_{k}_std": float(np.std(v)) for k, v in parts.items()},
        "zero_std_frac": float((grouped.std(dim=1) == 0).float().mean()),  # groups without signal
    }
