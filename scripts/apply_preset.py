"""Put a preset over params.yaml: ``python scripts/apply_preset.py presets/seed003.yaml [params.yaml]``.

A preset names only what differs from the embedded default; every key it names replaces that
key's value in params.yaml (comments kept), so params.yaml stays complete, as dvc.yaml's
``params:`` need. The result is validated; a bad preset changes nothing and fails with one line.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import yaml
from ruamel.yaml import YAML

from grpo.config import ParamsError, overlay_params, params_from_dict


def _float_yaml11(representer, value: float):
    """A float that YAML 1.1 readers (PyYAML, DVC's params) also read as a number: ``5.0e-06``,
    not ``5e-06``, which they read as text."""
    text = repr(value)
    if "e" in text and "." not in text.split("e")[0]:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


def apply_preset(preset: Path, params: Path) -> None:
    overrides = yaml.safe_load(preset.read_text()) or {}
    base = yaml.safe_load(params.read_text())
    params_from_dict(overlay_params(base, overrides))  # validate before writing anything
    rt = YAML()
    rt.representer.add_representer(float, _float_yaml11)
    doc = rt.load(params.read_text())
    for section, fields in overrides.items():
        for key, value in fields.items():
            doc[section][key] = value
    out = io.StringIO()
    rt.dump(doc, out)
    params.write_text(out.getvalue())


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    preset, params = Path(argv[0]), Path(argv[1] if len(argv) > 1 else "params.yaml")
    for path in (preset, params):
        if not path.exists():
            print(f"apply_preset: error: {path}: not found", file=sys.stderr)
            return 2
    try:
        apply_preset(preset, params)
    except ParamsError as err:
        print(f"apply_preset: error: {preset}: {err}", file=sys.stderr)
        return 2
    print(f"apply_preset: params.yaml <- {preset}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
