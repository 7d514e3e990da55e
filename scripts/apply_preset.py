"""Put a preset over params.yaml: ``python scripts/apply_preset.py presets/seed003.yaml [params.yaml]``.

A preset names only what differs from the embedded default; every key it names replaces that
key's value in params.yaml (comments kept), so params.yaml stays complete, as dvc.yaml's
``params:`` need (``grpo.config.reading.write_params``, which the flow's ``--set`` uses too). The result is
validated; a bad preset changes nothing and fails with one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpo.config.params import write_params
from grpo.config.reading import ParamsError, read_params_yaml


def apply_preset(preset: Path, params: Path) -> None:
    """Put ``preset`` over ``params``; a bad one raises ``ParamsError``, one line naming ``preset``."""
    overrides = read_params_yaml(preset)  # its errors name the file (and the line)
    for section, fields in overrides.items():  # sections of keys, as `grpo check --params` reads a preset
        if not isinstance(fields, dict):
            raise ParamsError(f"{preset}: {section}: must be a mapping, got {fields!r}")
    try:
        write_params(params, overrides)
    except ParamsError as err:
        raise ParamsError(f"{preset}: {err}") from None


PRESETS = Path(__file__).resolve().parent.parent / "presets"
"""The project's presets folder."""


def known_presets() -> str:
    """The words naming the project's presets (``PRESETS``), as paths to pass here from the current
    folder (relative below it, else absolute)."""
    found = sorted(PRESETS.glob("*.yaml"))
    here = Path.cwd().resolve()
    shown = [p.relative_to(here) if p.is_relative_to(here) else p for p in found]
    return f"the presets: {', '.join(map(str, shown))}" if found else f"{PRESETS} holds no presets (*.yaml)"


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    preset, params = Path(argv[0]), Path(argv[1] if len(argv) > 1 else "params.yaml")
    if not preset.is_file():
        print(f"apply_preset: error: {preset}: not found; {known_presets()}", file=sys.stderr)
        return 2
    if not params.exists():
        print(f"apply_preset: error: {params}: not found", file=sys.stderr)
        return 2
    try:
        apply_preset(preset, params)
    except ParamsError as err:
        print(f"apply_preset: error: {err}", file=sys.stderr)
        return 2
    print(f"apply_preset: params.yaml <- {preset}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
