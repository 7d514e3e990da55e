"""Phase 1 of a step (``grpo.training.rollout_phase``): per-completion sampling seeds (so a step's samples do not
depend on how its prompts are split into calls or processes), cut-off completions zeroed, and the
scoring of hand-written completions into rewards and group-relative advantages."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm.rewards import REWARDS
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.core.types import Rollout
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.rollout.rollout_backends import TransformersBackend
from grpo.training.rollout_phase import gather_rewards, sample, sample_seed, score, zero_cut_off

from .helpers import LORA

CPU = torch.device("cpu")


def test_sample_seeds_are_fixed_and_distinct_in_every_coordinate():
    """The same (seed, step, prompt, sample) gives the same 32-bit seed every time; changing any one
    coordinate changes it (no two of a grid of 2 x 3 x 4 x 8 collide); the run seed is taken mod 2^32."""
    grid = [(s, t, p, j) for s in (0, 1) for t in range(3) for p in range(4) for j in range(8)]
    seeds = [sample_seed(*key) for key in grid]
    assert seeds == [sample_seed(*key) for key in grid]
    assert len(set(seeds)) == len(grid) and all(0 <= x < 2**32 for x in seeds)
    assert sample_seed(0, 1, 2, 3) != sample_seed(0, 1, 3, 2)  # prompt and sample are not interchangeable
    assert sample_seed(-1, 0, 0, 0) == sample_seed(2**32 - 1, 0, 0, 0)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    tok = load_tokenizer(tiny_model_dir)
    return TransformersBackend(model, tok, dequantize=True), tok.pad_token_id  # as the trainer samples on the CPU


def test_a_steps_samples_do_not_depend_on_its_calls_or_processes(backend):
    """Two prompts (of one length: no padding differs) x G = 4 at temperature 1: one call, calls of
    3 completions (each group over two calls, 3 + 1) and the prompts sampled apart as two processes
    would (``first_prompt`` 0 and 1) give the same completions (drawn from the global generator
    instead, each call would go on from where the last left off)."""
    backend, pad = backend
    prompts = ["What is 1 + 2?", "What is 3 + 4?"]
    fields = dict(seed=5, rollouts={"group_size": 4, "max_new_tokens": 4, "temperature": 1.0})
    cfg = TrainConfig(**fields)
    whole = sample(backend, prompts, cfg, step=2, first_prompt=0, pad_id=pad)
    assert whole.completion_ids.shape[0] == 8
    calls = sample(backend, prompts, TrainConfig(seed=5, rollouts={**fields["rollouts"], "generation_batch_size": 3}), 2, 0, pad)
    apart = [sample(backend, prompts[i:i + 1], cfg, 2, i, pad) for i in range(2)]
    assert calls.texts == whole.texts
    assert apart[0].texts + apart[1].texts == whole.texts
    assert torch.equal(calls.completion_ids, whole.completion_ids)
    assert len(set(whole.texts)) > 1  # the samples of a group differ


def test_cut_off_completions_score_zero_everywhere():
    """The second and third of three completions did not finish: their total and every function's
    score become 0; the finished one keeps its values."""
    total, parts = zero_cut_off([True, False, False], [1.5, 1.0, 0.5],
                                {"correctness": [1.0, 1.0, 0.0], "format_soft": [1.0, 0.0, 1.0]})
    assert total == [1.5, 0.0, 0.0]
    assert parts == {"correctness": [1.0, 0.0, 0.0], "format_soft": [1.0, 0.0, 0.0]}


def _rollout(texts: list[str], finished: list[bool] | None = None) -> Rollout:
    n = len(texts)
    return Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                   torch.zeros(n, 3, dtype=torch.long), torch.ones(n, 3, dtype=torch.long), texts,
                   finished=None if finished is None else torch.tensor(finished))


def test_score_of_hand_written_completions():
    """Two prompts x G = 2 under correctness 1 + format_soft 0.5 (an int answer too): the totals by
    hand, the whole step's rewards and parts in prompt order, and the advantages within each group:
    (1.5, 0) centred is +-0.75, over the group's (Bessel) std 0.75 sqrt(2): +-1/sqrt(2); a group of
    equal rewards has advantages 0."""
    rows = [{"question": "3 + 4?", "answer": "7"}, {"question": "2 + 2?", "answer": 4}]
    texts = ["so #### 7", "it is 9", "#### 5", "#### 5"]
    cfg = TrainConfig(rewards={"correctness": 1.0, "format_soft": 0.5}, rollouts={"group_size": 2})
    scored = score(rows, 0, _rollout(texts), cfg, Dist(), CPU)
    assert scored.answers == ["7", "7", "4", "4"]
    assert scored.rewards == [1.5, 0.0, 0.5, 0.5]
    assert scored.step_rewards.tolist() == [1.5, 0.0, 0.5, 0.5]
    assert scored.step_reward_parts == {"correctness": [1.0, 0.0, 0.0, 0.0], "format_soft": [1.0, 0.0, 1.0, 1.0]}
    half = 1 / math.sqrt(2)
    torch.testing.assert_close(scored.advantages, torch.tensor([half, -half, 0.0, 0.0]), atol=1e-4, rtol=0)
    assert scored.rows == rows and scored.first_prompt == 0 and scored.rollout.texts == texts


def test_correctness_is_scored_for_the_log_when_it_is_not_a_reward():
    """Rewards without correctness: the totals are format_soft's alone, and correctness is still
    among the step's parts (the row's accuracy)."""
    texts = ["#### 7", "7"]
    cfg = TrainConfig(rewards={"format_soft": 1.0}, rollouts={"group_size": 2})
    scored = score([{"question": "3 + 4?", "answer": "7"}], 0, _rollout(texts), cfg, Dist(), CPU)
    assert scored.rewards == [1.0, 0.0]
    assert scored.step_reward_parts == {"format_soft": [1.0, 0.0], "correctness": [1.0, 1.0]}


@pytest.mark.parametrize("truncated", ["zero", "score"])
def test_a_cut_off_completion_scores_zero_unless_asked(truncated):
    """Two completions whose last number is the answer; the second was cut off at max_new_tokens
    (no EOS): under ``zero`` every reward of it is 0 (it never stated its answer), under ``score``
    its text is scored as the finished one's."""
    texts = ["3 + 4 = 7", "First 3, then 4, and 3 + 4 = 7"]
    rollout = _rollout(texts, finished=[True, False])
    cfg = TrainConfig(rewards={"correctness": 1.0, "format_soft": 0.5}, truncated=truncated, rollouts={"group_size": 2})
    scored = score([{"question": "3 + 4?", "answer": "7"}], 0, rollout, cfg, Dist(), CPU)
    full = REWARDS["correctness"](texts, ["7", "7"])
    assert full == [1.0, 1.0]
    if truncated == "zero":
        assert scored.rewards[1] == 0.0 and all(v[1] == 0.0 for v in scored.step_reward_parts.values())
        assert scored.rewards[0] > 0 and scored.advantages[0] > 0 > scored.advantages[1]
    else:
        assert scored.rewards[0] == scored.rewards[1] > 0 and scored.advantages.abs().max() == 0


def test_one_process_gathers_its_own_rewards():
    total, parts = [1.0, 0.0, 0.5], {"correctness": [1.0, 0.0, 0.0]}
    rewards, gathered = gather_rewards(Dist(), total, parts, CPU)
    assert rewards.dtype == torch.float32 and rewards.tolist() == total and gathered == parts
