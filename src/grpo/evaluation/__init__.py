"""What a run scored and what a set of runs shows.

    evaluate.py              greedy accuracy with an interval that counts a repeated problem once
    report.py                report.md / report.html with plots
    experiments.py           the experiments of a workspace side by side
    ablations.py, seed_stages.py   the grids (experiments/*.yaml) with paired, Holm-adjusted statistics
    seed_headline.py, headline_pages.py   the headline over seeds; the pages that quote it

May import: every package below it (grpo.core ... grpo.training).
"""
