"""Print the longest functions and classes of a source tree, in lines (docstrings and comments included).

    python scripts/code_size.py [src/grpo] [--top 5]

A plain measure of how much a reader must hold at once; issue 20 quotes its before/after figures.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def spans(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, "file:line name") of every function (methods included) and every class under ``root``."""
    funcs, classes = [], []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                entry = (node.end_lineno - first + 1, f"{path}:{node.lineno} {node.name}")
                (classes if isinstance(node, ast.ClassDef) else funcs).append(entry)
    return sorted(funcs, reverse=True), sorted(classes, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default="src/grpo")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    funcs, classes = spans(Path(args.root))
    for title, rows in (("functions", funcs), ("classes", classes)):
        print(f"longest {title} in {args.root}:")
        for n, where in rows[: args.top]:
            print(f"  {n:4d}  {where}")


if __name__ == "__main__":
    main()
