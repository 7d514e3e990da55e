"""Semantic entropy on hand-worked cases, and the curriculum schedule."""

import math

import pytest

from grpo.sent import (
    batch_indices,
    cluster_ids,
    curriculum_order,
    score_prompt,
    semantic_entropy,
    sort_by_entropy,
    stage_of_step,
)


@pytest.mark.parametrize("logprobs", [None, [-0.1, -2.0, -5.0, -0.7]])
def test_all_answers_equal_is_zero(logprobs):
    assert semantic_entropy(["7", "7", "7", "7"], logprobs) == 0.0


@pytest.mark.parametrize("m", [2, 5, 8])
def test_distinct_answers_count_estimator_is_log_m(m):
    assert semantic_entropy([str(i) for i in range(m)], None) == pytest.approx(math.log(m))


def test_likelihood_weighting_by_hand():
    # weights e^-1, e^-1, e^-2 -> p("5") = 2 / (2 + e^-1), p("7") = e^-1 / (2 + e^-1)
    p5 = 2 / (2 + math.exp(-1))
    p7 = 1 - p5
    expected = -(p5 * math.log(p5) + p7 * math.log(p7))
    assert p5 == pytest.approx(0.844637, abs=1e-6)
    assert semantic_entropy(["5", "5", "7"], [-1.0, -1.0, -2.0]) == pytest.approx(expected)
    # the count estimator ignores the likelihoods: p = (2/3, 1/3)
    count = semantic_entropy(["5", "5", "7"], None)
    assert count == pytest.approx(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)))
    assert abs(count - expected) > 0.1


def test_equal_likelihoods_match_count_estimator():
    answers = ["1", "2", "2", None]
    assert semantic_entropy(answers, [-0.5] * 4) == pytest.approx(semantic_entropy(answers, None))


def test_unanswered_responses_are_singleton_clusters():
    assert cluster_ids([None, None, "3", "3"]) == [0, 1, 2, 2]
    # p = 1/4, 1/4, 1/2 -> H = 1.5 ln 2
    assert semantic_entropy([None, None, "3", "3"]) == pytest.approx(1.5 * math.log(2))
    assert semantic_entropy([None, None, None]) == pytest.approx(math.log(3))


def test_length_mismatch_and_empty_raise():
    with pytest.raises(ValueError):
        semantic_entropy(["1", "2"], [-1.0])
    with pytest.raises(ValueError):
        semantic_entropy([])


def test_score_prompt_clusters_equivalent_final_answers():
    completions = ["So 1000 apples.\n#### 1,000", "The answer is 1000.", "#### 1000.00", "I am not sure"]
    out = score_prompt(completions, [-0.2, -0.3, -0.1, -2.0], "count")
    # "I am not sure" has no number: its own cluster
    assert out["num_clusters"] == 2
    assert out["answer_counts"] == {"1000": 3, "none": 1}
    assert out["semantic_entropy"] == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert out["semantic_entropy"] == out["semantic_entropy_count"]
    weighted = score_prompt(completions, [-0.2, -0.3, -0.1, -2.0], "likelihood")
    assert weighted["semantic_entropy"] < out["semantic_entropy"]  # the odd one out is the least likely


def test_sort_is_ascending_and_stable():
    rows = [{"id": "a", "semantic_entropy": 0.5}, {"id": "b", "semantic_entropy": 0.0},
            {"id": "c", "semantic_entropy": 0.5}, {"id": "d", "semantic_entropy": 0.0}]
    assert [r["id"] for r in sort_by_entropy(rows)] == ["b", "d", "a", "c"]


def test_curriculum_stages_are_contiguous_shuffled_slices():
    stages = curriculum_order(10, 3, seed=0)
    assert [sorted(s) for s in stages] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert curriculum_order(10, 3, seed=0) == stages
    assert curriculum_order(10, 1, seed=0) != curriculum_order(10, 1, seed=1)
    with pytest.raises(ValueError):
        curriculum_order(3, 4, seed=0)


def test_steps_are_split_evenly_over_stages_in_order():
    steps, k = 10, 2
    stages = [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert [stage_of_step(s, steps, 3) for s in range(steps)] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    # stage 0 begins at step 0, stage 1 at step 4 (ceil(10/3)), stage 2 at step 7 (ceil(20/3))
    assert batch_indices(stages, 0, steps, k) == [0, 1]
    assert batch_indices(stages, 1, steps, k) == [2, 0]  # wraps within the stage
    assert batch_indices(stages, 4, steps, k) == [3, 4]
    assert batch_indices(stages, 6, steps, k) == [3, 4]  # (6 - 4) * 2 = 4 -> wraps to 0
    assert batch_indices(stages, 7, steps, k) == [7, 8]
    assert batch_indices(stages, 9, steps, k) == [8, 9]
