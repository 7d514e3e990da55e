"""The curriculum schedule: stages of row indices and the rows of each step."""

import pytest

from grpo.algorithm.curriculum import batch_indices, curriculum_order, stage_of_step, stages_for


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


def test_orders_cover_every_row_once():
    for order in ("curriculum", "reversed", "shuffled", "file"):
        stages = stages_for(order, 11, 4, seed=3)
        assert sorted(i for s in stages for i in s) == list(range(11)), order
    assert stages_for("file", 5, 4, seed=0) == [[0, 1, 2, 3, 4]]
    assert len(stages_for("curriculum", 3, 8, seed=0)) == 3  # never more stages than rows


def test_reversed_takes_the_hardest_slice_first():
    forward = stages_for("curriculum", 12, 3, seed=5)
    backward = stages_for("reversed", 12, 3, seed=5)
    assert backward == forward[::-1]
    assert min(backward[0]) == 8 and max(backward[-1]) == 3  # rows sorted easy -> hard: the last rows first
