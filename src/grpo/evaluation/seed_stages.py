"""The stages a grid's experiments of one seed share, run once per seed instead of once per experiment.

A queued DVC experiment starts from the workspace as it was queued. Its stages whose outputs
include ``cache: false`` files (every stage here: its timing file, its metrics) never enter DVC's
run cache, so an experiment whose seed moves the data split reran the data, SENT and baseline
stages although the variant before it, of the same seed, had just made the same bytes. The fix:
before one seed's experiments are queued, the grid sets the seed keys in ``params.yaml`` and runs
the shared stages (``dvc repro``) in the workspace; the queued experiments then start from a
``dvc.lock`` that already holds them and skip them ("didn't change"). The results are the same
bytes (the stages are deterministic per CPU kind); only the repeats are gone.

A stage is shared when no variant sets one of its params (a key, the section above it or a key
below it) and every stage it reads from is shared too. ``restore`` puts ``params.yaml``,
``dvc.lock`` and those stages' outputs back as the commit has them when the grid is done.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

from grpo.config.params import write_params
from grpo.core.dvcfile import PARAMS_YAML, Stage
from grpo.evaluation.experiments import dvc

LOCK = "dvc.lock"


def _overlaps(a: str, b: str) -> bool:
    """Two params keys or two paths that name the same thing, or one inside the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".") or a.startswith(b + "/") or b.startswith(a + "/")


def shared_stages(stages: dict[str, Stage], variant_keys: Iterable[str]) -> list[str]:
    """The names of ``stages`` (``grpo.core.dvcfile.read_stages``) that every experiment of one seed
    runs alike, in ``dvc.yaml``'s order: none of their params is set by a variant (``variant_keys``:
    every key any variant overrides), none reads all of ``params.yaml``, and every stage whose
    outputs they depend on is shared too (a guard, ``Stage.guard``, writes the same bytes for every valid
    variant: it runs in each experiment and holds no stage back)."""
    keys = list(variant_keys)
    producer = {out: name for name, st in stages.items() for out in st.outs}
    memo: dict[str, bool] = {}

    def shared(name: str) -> bool:
        if name not in memo:
            memo[name] = False  # a cycle (not a valid dvc.yaml) is not shared
            st = stages[name]
            upstream = {producer[out] for dep in st.deps for out in producer if _overlaps(dep, out)} - {name}
            upstream = {u for u in upstream if not stages[u].guard}  # the same output for every valid variant
            memo[name] = (not st.all_params and not st.templated
                          and not any(_overlaps(p, k) for p in st.params for k in keys)
                          and all(shared(u) for u in upstream))
        return memo[name]

    return [name for name in stages if shared(name)]


def prepare_seed(root: Path, seed_keys: Iterable[str], seed: int, stages: list[str]) -> None:
    """Set every seed key to ``seed`` in ``root``'s ``params.yaml`` (comments kept, validated) and
    run ``stages`` there (``dvc repro``), so experiments queued next start with them done."""
    write_params(root / PARAMS_YAML, dict.fromkeys(seed_keys, seed))
    proc = dvc(root, ["repro", *stages], capture=False)
    if proc.returncode != 0:
        raise RuntimeError(f"dvc repro {' '.join(stages)} for seed {seed} failed (exit code {proc.returncode})")


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def touched_files(root: Path, stages: dict[str, Stage], names: list[str]) -> list[str]:
    """The git-tracked files ``prepare_seed`` rewrites: ``params.yaml``, ``dvc.lock`` and the shared
    stages' ``cache: false`` outputs that git keeps."""
    uncached = [out for name in names for out in stages[name].uncached]
    tracked = _git(root, "ls-files", "--", *uncached).stdout.split() if uncached else []
    return [PARAMS_YAML, LOCK, *tracked]


def check_clean(root: Path, files: list[str]) -> None:
    """``RuntimeError`` naming the files of ``files`` that differ from the commit: the grid rewrites
    them while it runs and puts the commit's back when it is done, which would lose those changes."""
    changed = _git(root, "status", "--porcelain", "--", *files).stdout.splitlines()
    if changed:
        raise RuntimeError(f"{', '.join(line[3:] for line in changed)}: uncommitted changes; commit or stash them "
                           f"first (the grid runs each seed's shared stages in the workspace, then restores "
                           f"{PARAMS_YAML} and {LOCK} as committed)")


def restore(root: Path, files: list[str], names: list[str]) -> str | None:
    """Put ``files`` back as the commit has them (a file it lacks is removed) and check the shared
    stages' cached outputs out again (``dvc checkout``); the line to print when the outputs could not
    be (not in the cache, or the commit's lock does not name them)."""
    in_head = set(_git(root, "ls-tree", "--name-only", "HEAD", "--", *files).stdout.split())
    for file in files:  # one at a time: a path the commit lacks would fail a joint checkout
        if file in in_head:
            _git(root, "checkout", "HEAD", "--", file)
        else:  # made by the grid (check_clean refused an untracked one at the start)
            (root / file).unlink(missing_ok=True)
    proc = dvc(root, ["checkout", *names])
    if proc.returncode != 0:
        return (f"ablations: the workspace's {', '.join(names)} outputs are not those of {LOCK} (not in the cache); "
                f"`dvc repro {' '.join(names)}` or `dvc pull` makes them so")
    return None

