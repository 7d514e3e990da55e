"""The device check's phase budgets, derived from what the phases took on cards: the one home of
every phase's need and limit (``bench/device_check.py`` runs them, docs/gpu-notes.md shows the table).

The figures are read from the runs' own JSON (``H200_RUN``: the H200 at d650e3f, its device check
and the two runs beside it; ``H100_RUNS``: the H100's three device checks, for the phases the H200
did not run), never copied (``figures``). Each phase's need is a formula over them (``NEEDS``: the
seconds it is expected to take on a card at the default call's sizes, said in words beside it);
where a part was never measured, the guess is a named constant (``PROFILE_WINDOW_S``,
``LANE_FACTOR``) that the next card's JSON replaces. A default phase's limit is its need rounded up
to ``ROUND_S``; the last default phase (``train_stage``, which leaves out the parts that would not
fit) gets what the budget leaves. The train stage's need follows ``bench/device_train.py``'s own
rule for starting a part (``EXPECTED`` and ``EXPORT_S``: a part starts only when its expected time
fits), so a need that fits means every part starts. ``budgets`` refuses a default call whose needs
do not fit it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
H200_RUN = REPO / "docs" / "gpu-runs" / "2026-11-28-h200"
H100_RUNS = sorted((REPO / "docs" / "gpu-runs").glob("2026-11-26-h100-run*.json"))
ROUND_S = 1
"""A limit is its need rounded up to a multiple of this."""
PROFILE_WINDOW_S = 5
"""Seconds the update phase's profiled micro-batch adds, its events parsed included (a guess: never
measured on a card; the phase's JSON has ``profile.window_s`` and the step's seconds)."""
LANE_FACTOR = 1.15
"""Seconds of two train stage processes side by side over the longer alone (a guess: they are
launch-bound, each on its own CPU cores, the card mostly idle; ``train_stage``'s JSON shows it)."""
UNCOMPILED_TOKENS = 64
"""Tokens of the generation phase's uncompiled reference (``decode_speed.py --uncompiled-tokens``):
enough to compare its tokens with the compiled step's; its 512 tokens were 35.2 ms each at d650e3f."""
NEW_TOKENS = 512
"""Seed 003's completion length: the generation phase's and the train stage's."""


class Budget(NamedTuple):
    need_s: float
    """Seconds the phase is expected to take on a card."""
    limit_s: float
    """Seconds at most."""
    basis: str
    """Where the need comes from, with the figures."""


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def figures() -> dict[str, float]:
    """The measured figures the needs rest on, by name (seconds unless named ``_ms``)."""
    first = _load(H200_RUN / "device_check.json")
    gen = _load(H200_RUN / "call2-gen2.json")["variants"]
    train = _load(H200_RUN / "call2-train.json")
    phase = {k: v["seconds"] for k, v in first["phases"].items()}
    h100 = {}
    for path in H100_RUNS:
        for k, v in _load(path)["phases"].items():
            if v["seconds"] is not None:
                h100[k] = max(h100.get(k, 0.0), v["seconds"])
    unbroken = train["unbroken"]
    nf4, dense = first["generation"]["variants"]["nf4-dynamic"], first["generation"]["variants"]["dense-dynamic"]
    return {
        "probe_s": phase["probe"],
        "update_phase_s": phase["update"],
        "update_step_s": first["update"]["step_s"],
        "context_phase_s": phase["context"],
        "sampler_setup_s": phase["samplers"] - first["samplers"]["sent"]["seconds"],
        "sent_call_s": first["samplers"]["sent"]["seconds"],
        "generation_load_s": phase["generation"] - nf4["seconds"] - dense["seconds"],
        "compile_s": gen["dense-static-graph"]["first_call_s"],
        "graph_ms": gen["dense-static-graph"]["ms_per_token"],
        "static_ms": gen["dense-static"]["ms_per_token"],
        "stage_tokens": train["completion_tokens"],
        "stage_s": unbroken["seconds"],
        "stage_outside_s": unbroken["seconds"] - sum(unbroken["step_s"]),
        "stage_update_s": unbroken["step_s"][-1] - unbroken["generate_s"][-1],
        "killed_s": train["killed"]["seconds"],
        "resumed_s": train["resumed"]["seconds"],
        "build_s": train["build_s"],
        "export_s": train["dense_export"]["seconds"],
        "h100_tests_s": h100["tests"], "h100_nan_guard_s": h100["nan_guard"], "h100_nf4_rows_s": h100["nf4_rows"],
        "h100_step_s": h100["step"],
    }


def train_parts(f: dict) -> dict[str, float]:
    """The train stage's processes at ``NEW_TOKENS`` with the step compiled once per process (the
    validation shares the rollouts' shape): the H200's processes at ``stage_tokens``, plus a
    compile, the longer update of each step (``update_step_s``, measured at 512, against the
    stage's at ``stage_tokens``) and the compiled decoding of the extra tokens."""
    per_step = (f["update_step_s"] - f["stage_update_s"]) + (NEW_TOKENS - f["stage_tokens"]) * f["graph_ms"] / 1000
    return {"setup": f["stage_outside_s"] + f["build_s"] + f["export_s"],
            "unbroken": f["stage_s"] + f["compile_s"] + 2 * per_step,
            "killed": f["killed_s"] + f["compile_s"] + per_step,
            "resumed": f["resumed_s"] + f["compile_s"] + per_step}


def train_need(t: dict[str, float], margin_s: float) -> float:
    """The train stage's seconds from its process's start to the last part's end, with the parts
    started as ``device_train.Clock.fits`` starts them: the unbroken run alone, then the resume lane
    (killed, resumed) beside the kernels' lane (unbroken again), each ``LANE_FACTOR`` slower; a part
    needs its expected time (``EXPECTED`` x the unbroken run's) and ``EXPORT_S`` left when it starts."""
    from device_train import EXPECTED, EXPORT_S

    u, lanes_start = t["unbroken"], t["setup"] + t["unbroken"]
    resumed_start = lanes_start + LANE_FACTOR * t["killed"]
    resume_end = resumed_start + max(EXPECTED["resumed"] * u + EXPORT_S, LANE_FACTOR * t["resumed"])
    again_end = lanes_start + max(EXPECTED["unbroken_again"] * u + EXPORT_S, LANE_FACTOR * u)
    return max(resume_end, again_end) + margin_s


def needs(train_margin_s: float = 0.0) -> dict[str, tuple[float, str]]:
    """Phase -> (need in seconds, its basis in words); ``train_margin_s``: what the device check's
    train phases keep back of their limit beyond the script's budget."""
    f = figures()
    call = f["compile_s"] + f["sent_call_s"] * f["graph_ms"] / f["static_ms"]
    load = f["update_phase_s"] - 2 * f["update_step_s"]
    t = train_parts(f)
    from device_train import EXPECTED

    det = EXPECTED["deterministic"] + EXPECTED["deterministic_again"]
    g = {k: round(v, 2) for k, v in f.items()}
    return {
        "probe": (f["probe_s"], f"the H200's probe {g['probe_s']} s"),
        "update": (f["update_phase_s"] + PROFILE_WINDOW_S,
                   f"the H200's update phase {g['update_phase_s']} s (load {round(load, 1)} s and two steps of "
                   f"{g['update_step_s']} s) + {PROFILE_WINDOW_S} s for the profiled micro-batch"),
        "samplers": (f["sampler_setup_s"] + f["stage_outside_s"] + 2 * call,
                     f"setup {g['sampler_setup_s']} s + a second process {g['stage_outside_s']} s + 2 calls of a "
                     f"compile {g['compile_s']} s and SENT's {g['sent_call_s']} s x {g['graph_ms']}/{g['static_ms']} ms"),
        "generation": (f["generation_load_s"] + UNCOMPILED_TOKENS * f["static_ms"] / 1000 + f["compile_s"]
                       + 2 * NEW_TOKENS * f["graph_ms"] / 1000,
                       f"load {g['generation_load_s']} s + {UNCOMPILED_TOKENS} x {g['static_ms']} ms + compile "
                       f"{g['compile_s']} s + 2 x {NEW_TOKENS} x {g['graph_ms']} ms"),
        "train_stage": (train_need(t, train_margin_s),
                        f"setup {round(t['setup'], 1)} s + unbroken {round(t['unbroken'], 1)} s + x{LANE_FACTOR} of "
                        f"the longer lane: killed {round(t['killed'], 1)} + resumed {round(t['resumed'], 1)} s beside "
                        f"unbroken again (the H200's processes at {g['stage_tokens']:.0f} tokens + a compile "
                        f"{g['compile_s']} s + the longer steps), as device_train starts them, + {train_margin_s:.0f} s"),
        "context": (f["context_phase_s"], f"the H200's context {g['context_phase_s']} s"),
        "rules": (2 * f["update_phase_s"], f"two update phases of {g['update_phase_s']} s (the default's own: the "
                                           "update phase's is profiled)"),
        "deterministic": (t["setup"] + t["unbroken"] * (1 + det) + train_margin_s,
                          f"setup {round(t['setup'], 1)} s + unbroken {round(t['unbroken'], 1)} s x (1 + {det}: "
                          "device_train.EXPECTED's guess for the two deterministic runs)"),
        "tests": (f["h100_tests_s"], f"the H100's longest tests phase {g['h100_tests_s']} s"),
        "nan_guard": (f["h100_nan_guard_s"], f"the H100's nan_guard {g['h100_nan_guard_s']} s"),
        "nf4_rows": (f["h100_nf4_rows_s"], f"the H100's nf4_rows {g['h100_nf4_rows_s']} s"),
        "step": (f["h100_step_s"], f"the H100's step phase {g['h100_step_s']} s"),
    }


def round_up(seconds: float) -> float:
    return float(ROUND_S * math.ceil(seconds / ROUND_S))


def budgets(default: tuple[str, ...], budget_s: float, margin_s: float, train_margin_s: float) -> dict[str, Budget]:
    """Every phase's ``Budget``: a limit its need rounded up (a non-default phase's with a quarter
    more: it runs in a call of its own); the last of ``default`` gets what ``budget_s`` less
    ``margin_s`` and the other default limits leave. Raises ``ValueError`` when that is under its need."""
    out = {}
    for name, (need, basis) in needs(train_margin_s).items():
        out[name] = Budget(round(need, 1), round_up(need if name in default else 1.25 * need), basis)
    last = default[-1]
    rest = budget_s - margin_s - sum(out[n].limit_s for n in default[:-1])
    if rest < out[last].need_s:
        raise ValueError(f"the default phases need more than the {budget_s:.0f} s budget: {last} would get "
                         f"{rest:.0f} s of the {out[last].need_s:.0f} s it needs")
    out[last] = out[last]._replace(limit_s=float(math.floor(rest)))
    return out


def table(found: dict[str, Budget], default: tuple[str, ...], margin_s: float) -> list[str]:
    """The budget table's lines: each phase's need, limit and basis, and the default call's sum."""
    lines = [f"  {'phase':<13} {'default':<7} {'need':>6} {'limit':>6}  basis"]
    lines += [f"  {n:<13} {'yes' if n in default else 'no':<7} {b.need_s:>6.1f} {b.limit_s:>6.0f}  {b.basis}"
              for n, b in found.items()]
    total = sum(found[n].limit_s for n in default) + margin_s
    lines.append(f"  default call: limits {total - margin_s:.0f} s + margin {margin_s:.0f} s = {total:.0f} s")
    return lines
