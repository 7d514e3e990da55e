"""The headline over seeds: what a grid of DVC experiments measured for each of its variants, read
by the report of a single run whose settings are one of those variants.

``python -m grpo.evaluation.ablations compare --headline PATH`` writes the file (``grpo.evaluation.ablations.headline``:
test accuracy before and after training as means over seeds, both with the 95% t interval across
seeds, and the mean effective n per seed); the report stage reads it (``PATH`` below, committed) and
shows the entry whose variant's overrides this run's params all match, so one run's figure is seen
beside the spread of the seeds it is one of.

File layout::

    {"cpu": "...", "grid": "experiments/rule_mu_grid.yaml", "chosen": "archer-mu2" | null,
     "variants": {name: {"overrides": {dotted key: value}, "seeds": [0, 1, ...],
                         "before": {"mean", "low", "high"}, "after": {...},
                         "n_eff_before", "n_eff_after", "rows"}}}
"""

from __future__ import annotations

import json
from pathlib import Path

PATH = "experiments/results/headline.json"


def read(path: str | Path) -> dict | None:
    """The headline file, or None where it does not exist."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def matching_variant(headlines: dict, flat_params: dict[str, object]) -> str | None:
    """The variant whose every override equals this run's value (``flat_params``: dotted key ->
    value), the first in the file's order; None when none does."""
    for name, entry in headlines.get("variants", {}).items():
        overrides = entry.get("overrides", {})
        if all(k in flat_params and flat_params[k] == v for k, v in overrides.items()):
            return name
    return None


def _interval(side: dict) -> str:
    return f"{side['mean']:.3f} [{side['low']:.3f}, {side['high']:.3f}]"


def words(headlines: dict | None, flat_params: dict[str, object], source: str = PATH) -> list[str]:
    """Markdown lines for the report: the matching variant's seed-mean headline, or one line saying
    that no variant of the grid ran this run's settings (or that there is no headline file)."""
    if not headlines:
        return [f"No headline over seeds (`{source}` is missing).", ""]
    name = matching_variant(headlines, flat_params)
    if name is None:
        return [f"Over seeds: this run's settings are none of the variants of `{headlines.get('grid', '?')}` "
                f"(`{source}`), so no spread over seeds is known for them.", ""]
    e = headlines["variants"][name]
    chosen = " (the default the grid chose)" if headlines.get("chosen") == name else ""
    if chosen and headlines.get("confirms"):
        chosen = f" (the default `{headlines['confirms']}` chose, on seeds it never saw)"
    n_eff = (f" Effective n per seed (operand multisets as clusters): {e['n_eff_before']:.0f} before, "
             f"{e['n_eff_after']:.0f} after, of {e['rows']:.0f} rows." if e.get("n_eff_before") and e.get("n_eff_after")
             and e.get("rows") else "")
    return [f"Over seeds (`{source}`: the grid `{headlines.get('grid', '?')}`, variant **{name}**{chosen}, "
            f"whose settings this run has): test accuracy **{_interval(e['before'])} -> {_interval(e['after'])}**, "
            f"the means over {len(e['seeds'])} seeds ({', '.join(map(str, e['seeds']))}) with their 95% t intervals "
            f"across seeds, one method before and after. Each seed draws its own splits, SENT samples and training "
            f"run and counts as one unit, so a problem repeated within a seed's test is not counted twice.{n_eff}", ""]
