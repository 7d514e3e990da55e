"""Print the longest functions and classes of a source tree, in lines (docstrings and comments
included), and its import cycles.

    python scripts/code_size.py [src/grpo] [--top 5]

A plain measure of how much a reader must hold at once. Wide signatures: every function taking more
than ``--max-params`` parameters (``self``/``cls`` not counted; ``*args``/``**kwargs`` one each;
``tests/test_layers.py`` holds src/grpo to 8). Import cycles: every ``import`` and
``from ... import`` of a module of the tree, at the top or inside a function (a lazy import is
still a dependency: DVC's deps follow it), as a graph of modules; each strongly connected
component of more than one module, and each module importing itself, is a cycle.
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


def wide_signatures(root: Path, limit: int = 8) -> list[tuple[int, str]]:
    """(parameters, "file:line name") of every function under ``root`` taking more than ``limit``
    parameters, the widest first."""
    wide = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                count = len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)
                if count > limit:
                    wide.append((count, f"{path}:{node.lineno} {node.name}"))
    return sorted(wide, reverse=True)


def module_name(path: Path, root: Path) -> str:
    """``src/grpo/rollout/engine/args.py`` -> ``grpo.rollout.engine.args`` (``__init__.py`` names its package)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (relative imports resolved; a ``from package
    import name`` counts the submodule ``package.name`` when there is one)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t:
                    graph[mod].add(t)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``: strongly connected components (``grpo.tools.code_deps.strongly_connected``)
    of two or more modules, and modules that import themselves."""
    from grpo.tools.code_deps import strongly_connected

    return sorted(sorted(c) for c in strongly_connected(graph) if len(c) > 1 or next(iter(c)) in graph[next(iter(c))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default="src/grpo")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--max-params", type=int, default=8)
    args = ap.parse_args()
    funcs, classes = spans(Path(args.root))
    for title, rows in (("functions", funcs), ("classes", classes)):
        print(f"longest {title} in {args.root}:")
        for n, where in rows[: args.top]:
            print(f"  {n:4d}  {where}")
    wide = wide_signatures(Path(args.root), args.max_params)
    print(f"functions over {args.max_params} parameters in {args.root}: {len(wide)}")
    for n, where in wide:
        print(f"  {n:4d}  {where}")
    cycles = import_cycles(import_graph(Path(args.root)))
    print(f"import cycles in {args.root}: {len(cycles)}")
    for comp in cycles:
        print("  " + " <-> ".join(comp))


if __name__ == "__main__":
    main()
