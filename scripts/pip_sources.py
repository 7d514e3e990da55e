"""Print pip's configured package sources as uv's flags, one per line (setup.sh's project install).

uv reads no pip configuration, so setup.sh hands it the sources pip would use: `index-url`,
`extra-index-url` and `find-links`, from pip's configuration files (sections `global` and `install`)
and its PIP_* variables, as `pip config list` reports them. pip's precedence holds: a PIP_* variable
over the `install` section over `global`. Nothing configured prints nothing (uv then uses PyPI, as pip
does). Other pip settings (constraints, certificates) are not carried over.

    python scripts/pip_sources.py     # e.g. --extra-index-url\\nfile:///mirror/simple
"""

from __future__ import annotations

import subprocess
import sys

KEYS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
SECTION_RANK = {"global": 0, "install": 1, ":env:": 2}  # a higher rank wins


def pip_settings(listing: str) -> dict[str, str]:
    """The winning value of each of KEYS in `pip config list` output (lines `section.key='value'`)."""
    best: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or key not in KEYS or section not in SECTION_RANK:
            continue
        rank = SECTION_RANK[section]
        if key not in best or rank >= best[key][0]:
            best[key] = (rank, value.strip().strip("'\""))
    return {key: value for key, (_, value) in best.items()}


def uv_flags(settings: dict[str, str]) -> list[str]:
    """uv's flags for pip's settings; a setting with several whitespace-separated values repeats its flag."""
    flags: list[str] = []
    for key, flag in KEYS.items():
        for value in settings.get(key, "").split():
            flags += [flag, value]
    return flags


def main() -> None:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    for flag in uv_flags(pip_settings(listing)):  # nothing at all when nothing is configured
        print(flag)


if __name__ == "__main__":
    main()
