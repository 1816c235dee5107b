"""The layer checks behind tests/test_architecture.py (the names checks are in tests/architecture_names.py),
written for any package directory so that each can be shown to fail on a few lines of synthetic source
(tests/test_architecture_checks.py) and run on hpc_garage itself.

Nothing is imported: every module is read as source (`ast`). What counts:

- **An edge** from one module of the package to another is an import at any depth (top level, inside a
  function, under `if TYPE_CHECKING:`), absolute or relative, or a string in code (not a docstring, not a
  comment) that hands a module of the package to a loader: the whole string is a dotted name (`"pkg.mod"`,
  `"pkg.mod.Class"`, `"pkg.mod:attr"`: importlib, Dask's preload, prefect-dask's `cluster_class`), or it holds
  `-m pkg.mod`, `import pkg.mod` or `from pkg.mod` (an argv, `python -c`, a template). A name of the package
  root alone counts when the next part is a name the root defines. Prose in a message loads nothing.
- **Reach** is the transitive closure of edges. Importing `pkg.a.b` also runs `pkg/__init__.py` and
  `pkg/a/__init__.py`: their top-level imports count for whoever imports `pkg.a.b` (their lazy ones do not,
  as nobody calls them by importing a sibling).
- **A circle** is a group of modules that import each other, at any depth; strings, `if TYPE_CHECKING:` and the
  implicit parent packages do not count (none of them runs an import of the other).
Each finding names the file and line.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+"
WHOLE_NAME = re.compile(rf"\s*({DOTTED})(?::[A-Za-z_][A-Za-z0-9_]*)?\s*")  # importlib, preload, cluster_class
NAME_IN_CODE = re.compile(rf"(?:(?<![\w-])-m\s+|\bimport\s+|\bfrom\s+)({DOTTED})")  # python -m / -c, templates


def by_name(text: str) -> list[str]:
    """The dotted names a string hands to a loader: the whole string (`"pkg.mod"`, `"pkg.mod:attr"`, a
    `cluster_class`), or `-m pkg.mod`, `import pkg.mod`, `from pkg.mod` inside it. Prose that mentions a
    module (an error message) loads nothing."""
    if whole := WHOLE_NAME.fullmatch(text):
        return [whole.group(1)]
    return [m.group(1) for m in NAME_IN_CODE.finditer(text)]


@dataclass(frozen=True)
class Edge:
    """One module of the package reaching another: where, and how (`imports`, `imports lazily`, `names`)."""

    source: str
    target: str
    path: Path
    line: int
    how: str
    top_level: bool
    typing_only: bool = False  # under `if TYPE_CHECKING:`: a dependency of the types, never run


def docstrings(tree: ast.AST) -> list[ast.Constant]:
    """Every docstring (module, class, function): prose, which may name anything."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.append(first.value)
    return found


def docstring_lines(tree: ast.AST) -> set[int]:
    return {line for d in docstrings(tree) for line in range(d.lineno, (d.end_lineno or d.lineno) + 1)}


def code_strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of every string constant of the code, f-strings' literal parts included, docstrings not."""
    skip = {id(d) for d in docstrings(tree)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value


@cache
def code_tokens(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every NAME and non-docstring STRING token: what the code itself says."""
    text = path.read_text()
    docstrings = docstring_lines(ast.parse(text))
    fstring_middle = getattr(tokenize, "FSTRING_MIDDLE", None)
    tokens = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME or (tok.type in (tokenize.STRING, fstring_middle)
                                         and tok.start[0] not in docstrings):
            tokens.append((tok.start[0], tok.string))
    return tokens


@cache
def code_lines(path: Path) -> list[tuple[int, str]]:
    """Each line of code with comments and docstrings removed (for call patterns such as `open(`)."""
    lines: dict[int, str] = {}
    text = path.read_text()
    docstrings = docstring_lines(ast.parse(text))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE) or tok.start[0] in docstrings:
            continue
        lines[tok.start[0]] = lines.get(tok.start[0], "") + tok.string
    return sorted(lines.items())


def _typing_only_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (never run)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                                         or isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"):
            found |= {id(sub) for part in node.body for sub in ast.walk(part)}
    return found


def _top_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes that run when the module is imported: not inside a function body."""
    found: set[int] = set()

    def visit(node: ast.AST) -> None:
        found.add(id(node))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                found.add(id(child))  # decorators and defaults run; the body does not
                for part in [*getattr(child, "decorator_list", []), *child.args.defaults,
                             *(d for d in child.args.kw_defaults if d is not None)]:
                    visit(part)
                continue
            visit(child)

    visit(tree)
    return found


class Package:
    """A package directory read as source: its modules, their edges, their reach."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.name = root.name
        self.modules: dict[str, Path] = {}
        self._edges: dict[str, list[Edge]] = {}
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            self.modules[".".join(parts)] = path

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root.parent))

    def where(self, path: Path, line: int) -> str:
        return f"{self.rel(path)}:{line}"

    @cached_property
    def trees(self) -> dict[str, ast.Module]:
        return {name: ast.parse(path.read_text(), str(path)) for name, path in self.modules.items()}

    def is_package(self, module: str) -> bool:
        return self.modules[module].name == "__init__.py"

    def part(self, module: str) -> str:
        """The top-level part a module belongs to: `core`, `files`, `__init__` (the root itself)."""
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    def own(self, dotted: str) -> bool:
        return dotted == self.name or dotted.startswith(self.name + ".")

    # ------------------------------------------------------------------------------------------ edges

    def resolve(self, dotted: str) -> str | None:
        """The longest prefix of a dotted name that is a module of the package; None for none."""
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in self.modules:
                return ".".join(parts[:end])
        return None

    def _root_names(self) -> set[str]:
        tree = self.trees.get(self.name)
        names: set[str] = set()
        for node in tree.body if tree else []:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.ImportFrom):
                names |= {a.asname or a.name for a in node.names}
        return names

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = module.split(".")
        if not self.is_package(module):
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def edges(self, module: str) -> list[Edge]:
        """Every edge out of a module (see the module docstring)."""
        if module not in self._edges:
            self._edges[module] = self._find_edges(module)
        return self._edges[module]

    def _find_edges(self, module: str) -> list[Edge]:
        tree, path = self.trees[module], self.modules[module]
        top, typing_only = _top_level_nodes(tree), _typing_only_nodes(tree)
        found: list[Edge] = []

        def add(target: str | None, node: ast.AST, how: str) -> None:
            if target is not None and target != module:
                at_top, typing = id(node) in top, id(node) in typing_only
                how = how if how == "names" else "imports for type checking" if typing else \
                    how if at_top else "imports lazily"
                found.append(Edge(module, target, path, node.lineno, how, at_top and not typing, typing))

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if self.own(alias.name):
                        add(self.resolve(alias.name), node, "imports")
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(module, node)
                if not self.own(base):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(sub if sub in self.modules else self.resolve(base), node, "imports")
        root_names = self._root_names()
        for line, text in code_strings(tree):
            for dotted in by_name(text):
                if not self.own(dotted):
                    continue
                target = self.resolve(dotted)
                if target == self.name and dotted.split(".")[1] not in root_names:
                    continue  # `pkg.something` that is no module and nothing the root defines (a logger name)
                add(target, _Line(line), "names")
        return found

    def parents(self, module: str) -> list[str]:
        """The packages whose `__init__` runs when `module` is imported."""
        parts = module.split(".")
        return [".".join(parts[:end]) for end in range(1, len(parts)) if ".".join(parts[:end]) in self.modules]

    def reach(self, start: str, stop: Callable[[str], bool] = lambda m: False,
              skip: Callable[[Edge], bool] = lambda e: False, parents: bool = True) -> dict[str, list[Edge]]:
        """Every module `start` reaches by edges, each with the shortest chain of edges there. A module for
        which `stop` is true is reached but not gone through; an edge for which `skip` is true is not followed.
        With `parents`, the packages whose `__init__` runs on the way add their top-level edges."""
        best: dict[str, list[Edge]] = {}
        seen = {(start, False)}
        queue: deque[tuple[str, bool, list[Edge]]] = deque([(start, False, [])])
        while queue:
            module, top_only, chain = queue.popleft()
            if module != start and not top_only and stop(module):
                continue
            for edge in self.edges(module):
                if (top_only and not edge.top_level) or skip(edge):
                    continue
                best.setdefault(edge.target, [*chain, edge])
                if (edge.target, False) not in seen:
                    seen.add((edge.target, False))
                    queue.append((edge.target, False, [*chain, edge]))
            for parent in self.parents(module) if parents else []:
                if (parent, True) not in seen and (parent, False) not in seen:
                    seen.add((parent, True))
                    queue.append((parent, True, chain))
        best.pop(start, None)
        return best

    def cycles(self) -> list[list[Edge]]:
        """Import circles: imports at any depth (not strings, not `if TYPE_CHECKING:`, not the implicit parent
        packages), one shortest circle for each group of modules that import each other."""
        graph = {m: [e for e in self.edges(m) if e.how != "names" and not e.typing_only] for m in self.modules}
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        groups: list[list[str]] = []

        def visit(module: str) -> None:  # Tarjan
            index[module] = low[module] = len(index)
            stack.append(module)
            on_stack.add(module)
            for edge in graph[module]:
                if edge.target not in index:
                    visit(edge.target)
                    low[module] = min(low[module], low[edge.target])
                elif edge.target in on_stack:
                    low[module] = min(low[module], index[edge.target])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    groups.append(group)

        for module in self.modules:
            if module not in index:
                visit(module)
        circles = []
        for group in groups:
            first = min(group)
            members = set(group)
            chains = self.reach(first, stop=lambda m: m not in members,
                                skip=lambda e: e.how == "names" or e.typing_only, parents=False)
            back = min((chains[m] + [e] for m in members - {first} if m in chains
                        for e in graph[m] if e.target == first), key=len)
            circles.append(back)
        return circles

    def describe(self, chain: Iterable[Edge]) -> str:
        return " → ".join(f"{self.where(e.path, e.line)} {e.how} {e.target}" for e in chain)


@dataclass(frozen=True)
class _Line:
    lineno: int


# ------------------------------------------------------------------------------------- the layer rules


def layer_offenders(package: Package, allowed: Mapping[str, set[str]], by_name_only: Mapping[str, set[str]] = {},
                    everywhere: Iterable[str] = ()) -> list[str]:
    """Each module's reach against what its part may reach: itself, `allowed[part]` (part names, `core`, and
    module names, `cluster.handoff`, reached through: its own reach must be allowed too) and `everywhere`.
    `by_name_only`: module → modules it names by dotted string without loading them (or for a loader
    elsewhere): those edges are not followed; the named module's own reach is checked as its part's."""
    offenders: dict[tuple[str, str], str] = {}
    prefix = package.name + "."
    everywhere = set(everywhere)

    def ok(part: str, target: str) -> bool:
        rel = target.removeprefix(prefix) if target != package.name else "__init__"
        rows = allowed.get(part, set()) | everywhere | {part}
        return package.part(target) in rows or any(rel == a or rel.startswith(a + ".") for a in rows)

    def exempt(edge: Edge) -> bool:
        return edge.how == "names" and edge.target.removeprefix(prefix) in \
            by_name_only.get(edge.source.removeprefix(prefix), set())

    for module in package.modules:
        part = package.part(module)
        chains = package.reach(module, stop=lambda m, part=part: not ok(part, m), skip=exempt)
        for target, chain in chains.items():
            if not ok(part, target):
                last = chain[-1]
                key = (part, package.where(last.path, last.line) + last.target)
                offenders.setdefault(key, f"{part} reaches {target}: {package.describe(chain)}")
    return sorted(offenders.values())


def by_name_edges(package: Package, by_name_only: Mapping[str, set[str]]) -> list[str]:
    """The declared by-name edges that the code no longer has (a stale exception hides nothing, but says what
    is no longer true)."""
    stale = []
    for source, targets in by_name_only.items():
        named = {e.target for e in package.edges(f"{package.name}.{source}") if e.how == "names"}
        stale += [f"{source} → {t}" for t in targets if f"{package.name}.{t}" not in named]
    return stale


def third_party_offenders(package: Package, parts: Iterable[str], modules: Iterable[str]) -> list[str]:
    """Imports (any depth) of the given modules of other packages (`prefect`, `urllib.request`, and what is
    below them) from the given parts; `from urllib import request` counts as `urllib.request`."""
    parts, modules = set(parts), set(modules)
    offenders = []
    for name, tree in package.trees.items():
        if package.part(name) not in parts:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            found = [n for n in names if any(n == m or n.startswith(m + ".") for m in modules)]
            offenders += [f"{package.where(package.modules[name], node.lineno)}: imports {found[0]}"] if found else []
    return offenders


def import_time_offenders(package: Package, module: str, heavy: Iterable[str]) -> list[str]:
    """Heavy third-party imports that run when `module` is imported: its top-level imports and those of what it
    imports at top level (and their parents' `__init__`)."""
    heavy = set(heavy)
    offenders = []
    chains = package.reach(module, skip=lambda e: not e.top_level or e.how == "names")
    run = [module, *chains]
    run += [parent for name in list(run) for parent in package.parents(name) if parent not in run]
    for name in dict.fromkeys(run):
        top = _top_level_nodes(package.trees[name])
        for node in ast.walk(package.trees[name]):
            if id(node) not in top:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for n in names:
                if n.split(".")[0] in heavy:
                    via = package.describe(chains.get(name, []))
                    offenders.append(f"{package.where(package.modules[name], node.lineno)}: imports {n} at "
                                     f"import time{' (via ' + via + ')' if via else ''}")
    return offenders
