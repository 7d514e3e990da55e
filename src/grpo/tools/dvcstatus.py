"""Which stages ``dvc repro`` would run in a workspace, for ``grpo check``.

``dvc status --json`` runs in a subprocess (the library never imports DVC) and names the stages
whose code, data, params or outputs changed; ``dvc.yaml`` gives the params each stage reads and
the stages downstream of a changed one (they run when an input they take from it changes).
A params file that is not the workspace's ``params.yaml`` (a preset) is compared key by key with
it: the stages reading a key it changes would run once it is put over ``params.yaml``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from grpo.core.dvcfile import DVC_DIR, DVC_YAML, Stage, read_stages
from grpo.core.messages import yaml_error_line


def _under(path: str, out: str) -> bool:
    return path == out or path.startswith(out.rstrip("/") + "/") or out.startswith(path.rstrip("/") + "/")


def downstream(graph: dict[str, Stage], names: set[str]) -> list[str]:
    """Stages that take an input from ``names`` or from a stage downstream of them (file order). A
    guard (``Stage.guard``: its outputs are the same whenever it succeeds) passes nothing on."""
    hit = set(names)
    changed = True
    while changed:
        changed = False
        for name, stage in graph.items():
            if name in hit:
                continue
            if any(_under(dep, out) for up in hit if not graph[up].guard for out in graph[up].outs for dep in stage.deps):
                hit.add(name)
                changed = True
    return [n for n in graph if n in hit and n not in names]


def flat_keys(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{"train.optimizer.lr": 5e-4, ...}``: one entry per leaf of a params mapping, at any depth (a
    mapping left empty is a leaf)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def stages_reading(graph: dict[str, Stage], keys: list[str]) -> list[str]:
    """Stages whose ``params:`` name one of ``keys`` (``section.key``) or its whole section."""
    return [name for name, stage in graph.items()
            if any(k == p or k.startswith(p + ".") for k in keys for p in stage.params)]


_DVC_NOISE = re.compile(r"https?://\S+|To suppress this check see:|Having any troubles\?.*|^\s*\d*\s*│.*|^\s*\d+\s*$")


def dvc_error_line(lines: list[str]) -> str:
    """DVC's error message (``lines``: its output) as one line: the message and the YAML problem it
    quotes (``found duplicate key "steps" ... line 3``), without the code excerpts, help links and
    hints that follow it (its last line is often such a link). A line repeated right after itself
    is kept once: DVC's "is busy" names the run holding the workspace once per output it locks."""
    start = next((i for i, x in enumerate(lines) if x.startswith("ERROR:")), 0)
    kept = [_DVC_NOISE.sub("", x).strip() for x in lines[start:]]
    kept = [x for i, x in enumerate(kept) if x and (i == 0 or x != kept[i - 1])]
    text = " ".join(kept).removeprefix("ERROR:").strip()
    return text.replace(' in "<unicode string>",', " at")


def dvc_status(root: Path, timeout: float = 120) -> dict | str:
    """``dvc status --json`` of ``root`` as a mapping, or a one-line reason why there is none."""
    try:
        proc = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"dvc status did not answer within {timeout:.0f} s"
    if proc.returncode != 0:
        lines = [x for x in (proc.stderr or proc.stdout).splitlines() if x.strip()]
        if any("No module named dvc" in x for x in lines):
            return "DVC is not installed"
        return "dvc status failed: " + (dvc_error_line(lines) or f"exit code {proc.returncode}")
    try:
        return json.loads(proc.stdout or "{}")
    except json.JSONDecodeError:
        return "dvc status printed no JSON"


def _why(changes: list) -> str:
    """A few words on what changed in one stage of ``dvc status --json``."""
    words: list[str] = []
    for change in changes:
        if isinstance(change, str):  # "always changed", "changed command"
            words.append(change)
            continue
        for kind, entries in change.items():
            if kind == "changed deps":
                params = sorted(k for v in entries.values() if isinstance(v, dict) for k in v)
                code = [p for p, v in entries.items() if isinstance(v, str) and (p.endswith(".py") or p.startswith(
                    ("src/", "tasks/", "flows/")))]
                data = [p for p, v in entries.items() if isinstance(v, str) and p not in code]
                if code:
                    words.append("code")
                if params:
                    words.append("params " + ", ".join(params))
                if data:
                    more = f" (+{len(data) - 3} more)" if len(data) > 3 else ""
                    words.append("inputs " + ", ".join(data[:3]) + more)
            elif kind == "changed outs":
                missing = any(v in ("deleted", "not in cache") for v in entries.values())
                words.append("outputs missing" if missing else "outputs modified")
            else:
                words.append(kind)
    return "; ".join(dict.fromkeys(words)) or "changed"


def describe(root: Path, changed_params: list[str] | None = None) -> list[str]:
    """Lines saying which stages ``dvc repro`` would run in ``root`` (one line when it cannot tell)."""
    if not (root / DVC_DIR).is_dir() or not (root / DVC_YAML).is_file():
        return [f"dvc: {root} is not a DVC workspace (it needs a .dvc folder and a dvc.yaml): no stage status"]
    try:
        graph = read_stages(root / DVC_YAML)
    except yaml.YAMLError as err:
        return [f"dvc: {yaml_error_line(root / DVC_YAML, err)}: no stage status"]
    status = dvc_status(root)
    if isinstance(status, str):
        lines = [f"dvc: {status}: no stage status"]
        changed: dict[str, str] = {}
    else:
        changed = {name: _why(changes) for name, changes in status.items() if name in graph}
        lines = []
    if changed_params:
        for name in stages_reading(graph, changed_params):
            keys = [k for k in changed_params if any(k == p or k.startswith(p + ".") for p in graph[name].params)]
            why = "this file changes " + ", ".join(keys[:4]) + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else "")
            changed[name] = f"{changed[name]}; {why}" if name in changed else why
    if isinstance(status, dict) or changed:
        if not changed:
            return ["dvc: up to date: `dvc repro` would run nothing"]
        lines.append(f"dvc: `dvc repro` would run {len(changed)} of {len(graph)} stages:")
        width = max(map(len, changed))
        lines += [f"  {name:<{width}}  {changed[name]}" for name in graph if name in changed]
        later = downstream(graph, set(changed))
        if later:
            lines.append(f"  and, when an input they take from those changes: {', '.join(later)}")
    return lines
