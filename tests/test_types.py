"""The records of ``grpo.core.types``."""

from __future__ import annotations

import torch

from grpo.core.types import Rollout


def test_rollout_concat_repads_prompts_left_and_completions_right():
    a = Rollout(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7]]), torch.tensor([[1]]), ["a"],
                torch.tensor([[-0.5]]))
    b = Rollout(torch.tensor([[8]]), torch.tensor([[1]]), torch.tensor([[9, 3]]), torch.tensor([[1, 1]]), ["b"],
                torch.tensor([[-1.0, -2.0]]))
    r = Rollout.concat([a, b], pad_id=0)
    assert r.prompt_ids.tolist() == [[5, 6], [0, 8]] and r.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert r.completion_ids.tolist() == [[7, 0], [9, 3]] and r.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert r.logprobs.tolist() == [[-0.5, 0.0], [-1.0, -2.0]] and r.texts == ["a", "b"]
    assert r.input_ids.tolist() == [[5, 6, 7, 0], [0, 8, 9, 3]]
