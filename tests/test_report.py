"""Report helpers: the smoothing of the training curves and the curve plot itself."""

from grpo.report import moving_average, plot_curves


def test_moving_average_is_a_trailing_mean():
    # window 2: [1], [1, 3], [3, 5], [5, 7]
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 5) == [2.0, 3.0]
    assert moving_average([], 3) == []


def test_curves_plot_with_and_without_a_separate_reward(tmp_path):
    steps = [{"step": i + 1, "stage": i // 3, "accuracy": i / 10, "reward_mean": i / 10} for i in range(8)]
    plot_curves(steps, tmp_path / "same.png")
    for r in steps:
        r["reward_mean"] += 0.1  # a format reward on top of correctness
    plot_curves(steps, tmp_path / "apart.png")
    assert (tmp_path / "same.png").stat().st_size > 1000 and (tmp_path / "apart.png").stat().st_size > 1000
