"""The stages' code dependencies in ``dvc.yaml``, derived from the import graph, and that graph's figures.

A stage depends on exactly the project files its entry module (``python -m tasks.X`` in its
``cmd``) imports, transitively: imports inside functions count (the stage runs them); those under
``if TYPE_CHECKING:`` (never run) and those in a block that ends by raising (an ``except`` handler
or an ``if`` body whose last statement is ``raise``: they only word an error, ``grpo.core.messages``) do
not. A module of a subpackage brings the package's ``__init__.py``, not its other modules; a
package all of whose modules (its subpackages' included) are reached is named by its directory. A module named to
``importlib`` (the registries of ``grpo.config.choices``) is no dependency: a registered name decides
whether params are valid, not what a stage writes.

Commands (``--root DIR``: the workspace, by default the nearest folder holding ``dvc.yaml``)::

    python -m grpo.tools.code_deps write   # rewrite each stage's src/ and tasks/ deps in dvc.yaml
    python -m grpo.tools.code_deps check   # one line per stale stage and exit 1; exit 0 when current
    python -m grpo.tools.code_deps graph   # the library's import graph: modules, lazy imports, levels, cycles, layers

``write`` replaces a stage's ``src/...`` and ``tasks/...`` items of ``deps:`` where the first of them
stood (the entry module first, then the other ``tasks/`` files, then ``src/``, each sorted) and
leaves every other line of the file as it was. No stage imports this module.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo.core.dvcfile import DVC_YAML, find_root, read_stages

PACKAGES = {"grpo": ("src", "grpo"), "tasks": ("tasks",)}
"""The project's top-level packages -> their folder, relative to the workspace."""
CODE_PREFIXES = ("src/", "tasks/")
"""The deps of ``dvc.yaml`` that this module owns: those naming project code."""
RUNS = ("module", "function")
"""The kinds of import a stage runs on its way to an output (``Import.kind``)."""
LAYERS = ("core", "algorithm", "data", "model", "rollout", "config", "training", "evaluation", "tools")
"""The packages of ``src/grpo``, from the bottom up: a module imports from its own package and those
before it only (``layer_breaches``). An import for a type checker alone (``typing``) may name a type
of a package above. Each package's ``__init__.py`` says what it holds."""


@dataclass(frozen=True)
class Import:
    """One project module named by an import statement of ``source`` (at ``line``). ``kind``:
    ``module`` (runs when ``source`` is imported), ``function`` (inside a function: runs when it is
    called), ``error`` (in a block that ends by raising), ``typing`` (under ``if TYPE_CHECKING:``)
    or ``importlib`` (a module name in a top-level table of a module that calls ``importlib``);
    ``in_function``: the statement lies in a function's body, whatever its kind."""

    source: Path
    target: Path
    line: int
    kind: str
    in_function: bool = False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _ids_within(blocks: list[list[ast.stmt]]) -> set[int]:
    return {id(n) for block in blocks for stmt in block for n in ast.walk(stmt)}


def _kinds(tree: ast.AST) -> dict[int, str]:
    """The kind (``Import.kind``) of every node of ``tree`` that is not a plain module-level one:
    ``typing`` wins over ``error``, which wins over ``function``."""
    typing, error, function = [], [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            typing.append(node.body)
        elif isinstance(node, ast.If) and node.body and isinstance(node.body[-1], ast.Raise):
            error.append(node.body)
        elif isinstance(node, ast.ExceptHandler) and node.body and isinstance(node.body[-1], ast.Raise):
            error.append(node.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            function.append(node.body if isinstance(node.body, list) else [ast.Expr(node.body)])
    kinds = dict.fromkeys(_ids_within(function), "function")
    kinds |= dict.fromkeys(_ids_within(error), "error")
    return kinds | dict.fromkeys(_ids_within(typing), "typing")


def _named(node: ast.AST) -> list[str]:
    """The dotted names an import statement may bring in (``from grpo import x`` may be ``grpo.x``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return []


def _calls_importlib(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree))


class Project:
    """The code of the workspace ``root``: its modules, their imports and what each stage reaches."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self._imports: dict[Path, list[Import]] = {}

    def module_file(self, name: str) -> Path | None:
        """The file of a project module (``grpo.x``, ``tasks.x``), or None for anything else."""
        top, _, rest = name.partition(".")
        if top not in PACKAGES or not rest:
            return None
        base = self.root.joinpath(*PACKAGES[top], *rest.split("."))
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
        return None

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def imports(self, path: Path) -> list[Import]:
        """Every project module the file ``path`` names in an import statement or an ``importlib``
        table, each once per statement, in the file's order."""
        if path not in self._imports:
            tree = ast.parse(path.read_text())
            kinds, found = _kinds(tree), []
            in_function = _ids_within([f.body for f in ast.walk(tree)
                                       if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))])
            for node in ast.walk(tree):
                targets = dict.fromkeys(t for t in map(self.module_file, _named(node)) if t is not None)
                found += [Import(path, t, node.lineno, kinds.get(id(node), "module"), id(node) in in_function)
                          for t in targets]
            if _calls_importlib(tree):
                found += self._importlib_tables(path, tree)
            self._imports[path] = sorted(found, key=lambda i: i.line)
        return self._imports[path]

    def _importlib_tables(self, path: Path, tree: ast.Module) -> list[Import]:
        """The project modules named by text in the top-level assignments of ``tree`` (a table of
        module names that the file hands to ``importlib``, ``grpo.config.choices.REGISTRIES``)."""
        found = []
        for stmt in tree.body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                for node in ast.walk(stmt.value):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        target = self.module_file(node.value)
                        if target is not None:
                            found.append(Import(path, target, node.lineno, "importlib"))
        return found

    def _packages(self, path: Path) -> list[Path]:
        """The ``__init__.py`` of every subpackage of ``grpo`` holding ``path`` (Python runs each
        when it imports a module inside)."""
        library, inits = self.root.joinpath(*PACKAGES["grpo"]), []
        for parent in path.parents:
            if parent == library or library not in parent.parents:
                break
            inits.append(parent / "__init__.py")
        return [p for p in inits if p.is_file()]

    def code_deps(self, entry: Path) -> set[str]:
        """Workspace-relative files a run of ``entry`` imports (the module docstring's rules)."""
        seen, todo = set(), [Path(entry).resolve()]
        while todo:
            path = todo.pop()
            if path in seen:
                continue
            seen.add(path)
            todo += [i.target for i in self.imports(path) if i.kind in RUNS] + self._packages(path)
        packages = sorted({p.parent for p in seen if p.name == "__init__.py"}, key=lambda p: -len(p.parts))
        for package in packages:  # the deepest first, so that a package's subpackages are named already
            if set(package.rglob("*.py")) <= seen | {f for q in seen if q.is_dir() for f in q.rglob("*.py")}:
                seen = {p for p in seen if package not in p.parents} | {package}
        return {self.relative(p) for p in seen} - {"tasks/__init__.py"}

    def entry(self, cmd) -> Path | None:
        """The entry module of a stage whose ``cmd`` runs ``python -m tasks.X``, else None."""
        text = " ".join(cmd) if isinstance(cmd, list) else str(cmd or "")
        match = re.search(r"-m\s+(tasks\.[\w.]+)", text)
        return self.module_file(match.group(1)) if match else None

    def stage_code_deps(self, cmd) -> list[str] | None:
        """The code deps of the stage with ``cmd`` in ``dvc.yaml``'s order: the entry module, the other
        ``tasks/`` files, then ``src/``, each sorted; None for a stage that runs no ``tasks`` module."""
        entry = self.entry(cmd)
        if entry is None:
            return None
        first = self.relative(entry)
        deps = self.code_deps(entry) - {first}
        return [first, *sorted(d for d in deps if d.startswith("tasks/")),
                *sorted(d for d in deps if not d.startswith("tasks/"))]


# -- dvc.yaml, as text ---------------------------------------------------------------------------

_STAGE = re.compile(r"^  ([^\s#][^:]*):\s*(#.*)?$")
_DEPS = re.compile(r"^(\s+)deps:\s*(#.*)?$")
_ITEM = re.compile(r"^(\s*)- (\S+?)\s*(#.*)?$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _stage_spans(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Stage name -> (first, end) line indices of its block under the top-level ``stages:``."""
    spans, inside, name, start = {}, False, None, 0
    for i, line in enumerate([*lines, "end:"]):
        top = line.strip() and not line.startswith((" ", "#"))
        match = _STAGE.match(line) if inside else None
        if (top or match) and name is not None:
            spans[name], name = (start, i), None
        if top:
            inside = line.split(":")[0] == "stages"
        elif match:
            name, start = match.group(1).strip(), i
    return spans


def _deps_list(lines: list[str], first: int, end: int) -> tuple[int, int] | None:
    """The (first, end) line indices of the items of the ``deps:`` list in ``lines[first:end]``."""
    for i in range(first, end):
        match = _DEPS.match(lines[i])
        if match:
            j = i + 1
            while j < end and (not lines[j].strip() or lines[j].lstrip().startswith("#")
                               or _indent(lines[j]) > len(match.group(1)) or lines[j].lstrip().startswith("- ")):
                j += 1
            while j > i + 1 and not lines[j - 1].strip():  # the blank lines between stages are not the list's
                j -= 1
            return i + 1, j
    return None


def _rewrite_items(items: list[str], code: list[str]) -> list[str]:
    """The lines ``items`` of a ``deps:`` list with its code items replaced by ``code``, where the first
    stood (at the list's end when there was none). A kept item keeps its line (and its comment)."""
    kept, at, out = {}, None, []
    indent = next((m.group(1) for m in map(_ITEM.match, items) if m), "      ")
    for line in items:
        match = _ITEM.match(line)
        if match and match.group(2).startswith(CODE_PREFIXES):
            kept[match.group(2)] = line
            at = len(out) if at is None else at
        else:
            out.append(line)
    at = len(out) if at is None else at
    return out[:at] + [kept.get(d, f"{indent}- {d}\n") for d in code] + out[at:]


def written(dvc_yaml: Path, project: Project) -> str:
    """The text of the file ``dvc_yaml`` with its stages' code deps rewritten from ``project``'s imports."""
    lines = Path(dvc_yaml).read_text().splitlines(keepends=True)
    stages = read_stages(dvc_yaml)
    for name, (first, end) in sorted(_stage_spans(lines).items(), key=lambda kv: -kv[1][0]):
        code = project.stage_code_deps(stages[name].cmd) if name in stages else None
        span = _deps_list(lines, first, end) if code is not None else None
        if span is not None:
            lines[span[0]:span[1]] = _rewrite_items(lines[span[0]:span[1]], code)
    return "".join(lines)


def stale(dvc_yaml: Path, project: Project) -> list[str]:
    """One line per stage of ``dvc_yaml`` whose code deps are not its imports (the files missing from
    its deps, those it does not import) or not in ``write``'s order; ``[]`` when all are current."""
    lines = []
    for name, spec in read_stages(dvc_yaml).items():
        expected = project.stage_code_deps(spec.cmd)
        if expected is None:
            continue
        declared = [d for d in spec.deps if d.startswith(CODE_PREFIXES)]
        missing, extra = sorted(set(expected) - set(declared)), sorted(set(declared) - set(expected))
        if missing or extra:
            lines.append(f"{name}: missing {missing or 'nothing'}, not imported {extra or 'nothing'}")
        elif declared != expected:
            lines.append(f"{name}: code deps out of order (python -m grpo.tools.code_deps write sorts them)")
    return lines


# -- the graph's figures ---------------------------------------------------------------------------

def strongly_connected(graph: dict) -> list[set]:
    """The strongly connected components of ``graph`` (node -> the nodes it points to; nodes that
    sort), by Tarjan's algorithm without recursion: a component comes after all those it reaches."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on:
                low[node] = min(low[node], index[child])
    return out


def _levels(graph: dict[Path, set[Path]]) -> dict[Path, int]:
    """Each module's level: 1 for a module importing none of ``graph``'s, else one more than the
    highest it imports; the modules of a cycle share one level (the cycle counts as one module)."""
    components = strongly_connected(graph)  # Tarjan yields a component after all those it reaches
    of = {m: i for i, c in enumerate(components) for m in c}
    level: dict[int, int] = {}
    for i, component in enumerate(components):
        below = {of[t] for m in component for t in graph[m]} - {i}
        level[i] = 1 + max((level[j] for j in below), default=0)
    return {m: level[of[m]] for m in graph}


def _graph(imports: list[Import], modules: list[Path], kinds: tuple[str, ...]) -> dict[Path, set[Path]]:
    graph = {m: set() for m in modules}
    for i in imports:
        if i.kind in kinds and i.target in graph and i.target != i.source:
            graph[i.source].add(i.target)
    return graph


def _chain(graph: dict[Path, set[Path]], level: dict[Path, int]) -> list[Path]:
    """A longest chain of imports, from the highest module down (one module per level)."""
    node = max(graph, key=lambda m: (level[m], str(m)))
    chain = [node]
    while below := [t for t in graph[node] if level[t] == level[node] - 1]:
        node = min(below, key=str)
        chain.append(node)
    return chain


def layer_of(project: Project, path: Path) -> int | None:
    """The index in ``LAYERS`` of the package holding the library module ``path``; None outside them."""
    parts = Path(project.relative(path)).parts
    if parts[:2] != PACKAGES["grpo"] or len(parts) < 4 or parts[2] not in LAYERS:
        return None
    return LAYERS.index(parts[2])


def layer_breaches(project: Project) -> list[Import]:
    """Every import of the library that runs (or names a module to ``importlib``) and reaches a package
    above its own in ``LAYERS``, in file order."""
    library = project.root.joinpath(*PACKAGES["grpo"])
    out = []
    for module in sorted(library.rglob("*.py")):
        here = layer_of(project, module)
        for i in project.imports(module):
            there = layer_of(project, i.target)
            if i.kind != "typing" and here is not None and there is not None and there > here:
                out.append(i)
    return out


def import_statements(project: Project) -> dict[tuple[Path, int], Import]:
    """Each statement of the library (``src/grpo``) that imports a grpo module, keyed by (file, line):
    one entry per statement, however many modules it names; ``importlib`` tables are not statements."""
    statements: dict[tuple[Path, int], Import] = {}
    for module in sorted(project.root.joinpath(*PACKAGES["grpo"]).rglob("*.py")):
        for i in project.imports(module):
            if i.kind != "importlib":
                statements.setdefault((module, i.line), i)
    return statements


def graph_report(project: Project) -> list[str]:
    """The lines of ``python -m grpo.tools.code_deps graph``: the library (``src/grpo``) as an import graph."""
    library = project.root.joinpath(*PACKAGES["grpo"])
    modules = sorted(library.rglob("*.py"))
    subpackages = sorted(p.parent for p in library.glob("*/__init__.py"))
    statements = import_statements(project)
    kinds = [i.kind for i in statements.values()]
    lazy = sum(i.in_function for i in statements.values())
    name = lambda p: project.relative(p).removeprefix("src/").removesuffix(".py").replace("/", ".")  # noqa: E731
    out = [f"src/grpo: {len(list(library.glob('*.py')))} top-level modules, {len(subpackages)} packages ("
           + ", ".join(f"{p.name} {len(list(p.rglob('*.py')))}" for p in subpackages) + " modules)",
           f"internal imports (statements naming a grpo module): {len(kinds)}, {lazy} inside functions "
           f"({lazy / max(len(kinds), 1):.0%}); of all, {kinds.count('function')} run when a function is called, "
           f"{kinds.count('error')} only on the way to a raise, {kinds.count('typing')} only for a type checker"]
    imports = [i for m in modules for i in project.imports(m)]
    top = _graph(imports, modules, ("module",))
    level = _levels(top)
    cycles_at_import = [c for c in strongly_connected(top) if len(c) > 1]
    chain = _chain(top, level)
    out.append(f"levels: {max(level.values())} (the longest chain of module-level imports, a cycle counted as one "
               f"level; module-level cycles: {len(cycles_at_import)}): " + " -> ".join(map(name, chain)))
    running = _graph(imports, modules, ("module", "function", "error", "importlib"))
    cycles = sorted((c for c in strongly_connected(running) if len(c) > 1), key=lambda c: sorted(map(str, c)))
    out.append(f"cycles of the running graph (module-level, in-function and importlib imports; not TYPE_CHECKING): "
               f"{len(cycles)}")
    for cycle in cycles:
        back = [i for i in imports if i.source in cycle and i.target in cycle and i.kind != "typing"
                and level[i.target] >= level[i.source]]
        out.append(f"  {len(cycle)} modules: " + ", ".join(sorted(map(name, cycle))))
        out.append(f"  imports that run back up (to a level at or above their own): {len(back)}")
        out += [f"    {project.relative(i.source)}:{i.line} -> {name(i.target)} ({i.kind}, level "
                f"{level[i.source]} -> {level[i.target]})" for i in back]
    breaches = layer_breaches(project)
    out.append(f"imports that run up the layers ({' < '.join(LAYERS)}): {len(breaches)}")
    out += [f"  {project.relative(i.source)}:{i.line} -> {name(i.target)} ({i.kind})" for i in breaches]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.tools.code_deps", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("write", "check", "graph"))
    parser.add_argument("--root", type=Path, default=None, help="the workspace (default: the nearest holding dvc.yaml)")
    args = parser.parse_args(argv)
    root = args.root or find_root(Path.cwd())
    if root is None:
        print(f"no {DVC_YAML} here or above; pass --root", file=sys.stderr)
        return 2
    project, dvc_yaml = Project(root), Path(root, DVC_YAML)
    if args.command == "graph":
        print("\n".join(graph_report(project)))
        return 0
    if args.command == "write":
        text, new = dvc_yaml.read_text(), written(dvc_yaml, project)
        if new != text:
            dvc_yaml.write_text(new)
        print(f"{dvc_yaml}: {'rewritten' if new != text else 'current'}")
        return 0
    problems = stale(dvc_yaml, project)
    print("\n".join(problems) if problems else f"{dvc_yaml}: every stage's code deps are its imports")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
