"""Semantic entropy on hand-worked cases."""

import math

import pytest

from grpo.rollout.semantic_entropy import cluster_ids, score_prompt, semantic_entropy, sort_by_entropy


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
    out = score_prompt(completions, [-0.2, -0.3, -0.1, -2.0], "count", "1000")
    # "I am not sure" has no number: its own cluster
    assert out["num_clusters"] == 2
    assert out["answer_counts"] == {"1000": 3, "none": 1}
    assert out["semantic_entropy"] == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert out["semantic_entropy"] == out["semantic_entropy_count"]
    weighted = score_prompt(completions, [-0.2, -0.3, -0.1, -2.0], "likelihood", "1000")
    assert weighted["semantic_entropy"] < out["semantic_entropy"]  # the odd one out is the least likely


@pytest.mark.parametrize(("answer", "completions", "expected"), [
    ("1,000", ["#### 1000", "#### 1,000", "#### 999"], 2 / 3),  # a reference written with a separator
    ("1/2", ["#### 0.5", "The answer is 1/2.", "#### 2"], 2 / 3),  # a fraction and its decimal
    ("18", ["#### 18.00", "#### $18", "no idea"], 2 / 3),
])
def test_pass_rate_scores_like_the_correctness_reward(answer, completions, expected):
    from grpo.algorithm.rewards import correctness

    out = score_prompt(completions, None, "count", answer)
    assert out["pass_rate"] == pytest.approx(expected)
    assert out["pass_rate"] == pytest.approx(sum(correctness(completions, [answer] * 3)) / 3)


def test_sort_is_ascending_and_stable():
    rows = [{"id": "a", "semantic_entropy": 0.5}, {"id": "b", "semantic_entropy": 0.0},
            {"id": "c", "semantic_entropy": 0.5}, {"id": "d", "semantic_entropy": 0.0}]
    assert [r["id"] for r in sort_by_entropy(rows)] == ["b", "d", "a", "c"]
