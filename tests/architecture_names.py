"""The names checks behind tests/test_architecture.py: other packages' private names, and literals that
belong in one place. Written for any package directory (see tests/architecture.py), read as source.

**Another package's private name** is, outside the modules allowed (compat/):
- an import of a `_name` from a module that is not the package's own, or of a module path with a `_part`;
- an attribute `x._name` (also `getattr/setattr/hasattr/delattr(x, "_name")`, or a private string in the
  statement of such a call, `hasattr(x, n) for n in ("_a", "_b")`) where `x` is bound by an import of another
  package, or where the package itself never defines `_name` (as a function, class, module- or class-level
  name, or an attribute it assigns: `self._name = …`, `obj._name = …`, `setattr(obj, "_name", …)`);
- a dunder attribute that is not Python's own (`__var__`), under the same two conditions.
So `self._queue` is the class's own when some code of the package assigns or defines `_queue`; a private
attribute inherited from another package's base class (`self._started`), never assigned here, is not. What
this cannot tell: a subclass that assigns its foreign base's private attribute (that counts as its own), and a
private attribute of a foreign object whose name the package also defines for itself. Names their package
documents as its API despite the underscore (`sys._getframe`) are listed in DOCUMENTED, each with where.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import re
import types
from collections.abc import Callable, Iterable

from tests.architecture import Package, code_strings, docstrings

# -------------------------------------------------------------------------------------- private names

PYTHON_DUNDERS = {n for t in (object, type, int, float, complex, str, bytes, list, dict, set, tuple, BaseException,
                              types.FunctionType, types.MethodType, types.ModuleType, types.CodeType,
                              types.GeneratorType, types.CoroutineType, types.GenericAlias, property,
                              classmethod, staticmethod,
                              contextlib.AbstractContextManager, contextlib.AbstractAsyncContextManager)
                  for n in dir(t) if n.startswith("__")} | \
                 {n for n in dir(builtins) if n.startswith("__")} | \
                 {"__version__", "__all__", "__path__", "__file__", "__wrapped__", "__dataclass_fields__",
                  "__set_name__", "__set__", "__delete__", "__getattr__", "__slots__", "__match_args__",
                  "__post_init__", "__fspath__", "__main__"}  # module, descriptor and dataclass protocol


# names with a leading underscore that their package documents as its API (each with where it says so)
DOCUMENTED = {
    "sys._getframe": "the Python docs, sys module",
    "os._exit": "the Python docs, os module",
    "__pydantic_decorators__": "pydantic's API docs: BaseModel's attributes",
}


def is_private(name: str) -> bool:
    """`_x` and `__x` (mangled) are private; dunders are private unless Python itself defines them."""
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        return name not in PYTHON_DUNDERS
    return name.startswith("_") and name != "_"


def defined_names(package: Package) -> set[str]:
    """Every name the package defines itself: functions, classes, module- and class-level names, attributes it
    assigns (`self._x = …`, `obj._x = …`, `setattr(obj, "_x", …)`)."""
    names: set[str] = set()
    for tree in package.trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name):
                            names.add(sub.id)
                        elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                            names.add(sub.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str):
                names.add(node.args[1].value)
    return names


_OWN: dict[int, set[str]] = {}


def _own_names(package: Package) -> set[str]:
    if id(package) not in _OWN:
        _OWN[id(package)] = defined_names(package)
    return _OWN[id(package)]


def _foreign_bindings(package: Package, tree: ast.Module) -> set[str]:
    """Names bound in a module by imports of another package (`import distributed`, `from x import y as z`)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if not package.own(a.name)}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and not package.own(node.module):
            bound |= {a.asname or a.name for a in node.names}
    return bound


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_part(part: str) -> bool:
    return part.startswith("_") and not part.endswith("__")  # `_internal`, not `__future__`


def _documented(value: ast.AST, attr: str) -> bool:
    return attr in DOCUMENTED or f"{_root_name(value)}.{attr}" in DOCUMENTED


def private_uses(package: Package, module: str, within: ast.AST | None = None,
                 ignore: Iterable[str] = ()) -> list[str]:
    """Uses of another package's private names in a module (or in one node of it): see the module docstring.
    `ignore`: names whose attributes are not looked at (compat's check of its declarations skips the
    standard library's modules)."""
    ignore = set(ignore)
    own = _own_names(package)
    tree = package.trees[module]
    path = package.modules[module]
    foreign = _foreign_bindings(package, tree)
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{package.where(path, node.lineno)}: {what}")

    parents = {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(within or tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not package.own(alias.name) and any(_private_part(p) for p in alias.name.split(".")):
                    flag(node, f"imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and not package.own(node.module):
            if any(_private_part(p) for p in node.module.split(".")):
                flag(node, f"imports from {node.module}")
            for alias in node.names:
                if is_private(alias.name):
                    flag(node, f"imports {alias.name} from {node.module}")
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and not _documented(node.value, node.attr):
            if _root_name(node.value) in foreign - ignore or (node.attr not in own and _root_name(node.value)
                                                               not in ignore):
                flag(node, f".{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
            # the name given as a string, or (`hasattr(x, n) for n in ("_a", "_b")`) any private string of the
            # statement that holds the call
            given = node.args[1]
            names = [given.value] if isinstance(given, ast.Constant) and isinstance(given.value, str) else \
                [c.value for c in ast.walk(_statement(parents, node)) if isinstance(c, ast.Constant)
                 and isinstance(c.value, str) and c.value.isidentifier()]
            root = _root_name(node.args[0])
            for name in names:
                if is_private(name) and not _documented(node.args[0], name) and \
                        (root in foreign - ignore or (name not in own and root not in ignore)):
                    flag(node, f"{node.func.id}(…, {name!r})")
    return found


def _statement(parents: dict[int, ast.AST], node: ast.AST) -> ast.AST:
    while not isinstance(node, ast.stmt) and id(node) in parents:
        node = parents[id(node)]
    return node


def private_offenders(package: Package, allowed_modules: Iterable[str]) -> list[str]:
    """Uses of another package's private names outside `allowed_modules` (see the module docstring)."""
    allowed = {f"{package.name}.{m}" for m in allowed_modules}
    return [o for module in package.modules if module not in allowed for o in private_uses(package, module)]


# ------------------------------------------------------------------------------------ strings in code


def literal_offenders(package: Package, pattern: str, allowed: Callable[[str, ast.Module, int], bool]) -> list[str]:
    """Code strings (not docstrings or comments) matching `pattern` where `allowed(module, tree, line)` is not
    true."""
    offenders = []
    for module, tree in package.trees.items():
        for line, text in code_strings(tree):
            if re.search(pattern, text) and not allowed(module, tree, line):
                offenders.append(f"{package.where(package.modules[module], line)}: {text!r}")
    return offenders


def constant_definitions(tree: ast.Module, pattern: str) -> dict[str, tuple[int, str]]:
    """Module-level `NAME = "literal"` whose literal matches `pattern`: name → (line, literal)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str) and re.fullmatch(pattern, node.value.value):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = (node.lineno, node.value.value)
    return found


# ------------------------------------------------------------------------------ batch-system names


def system_name_offenders(package: Package, parts: Iterable[str], names: Iterable[str],
                          site_names: Iterable[str] = ()) -> list[str]:
    """Batch-system names used as such in the code of `parts`, where the code should ask a batch system what
    it can do instead.

    A code string (not a docstring, not a comment) counts when it is, whole and in any case, one of `names`
    (`"slurm"`, `"PBS"`): there is no other reason to hold a bare system name. A name that is also a site's
    (`site_names`: `local` is the default site) counts only where the code decides by it: an operand of a
    comparison (`==`, `!=`, `in`, or an element of the tuple/list/set that `in` searches), a dict key, or a
    match case; `load_site(name or "local")` names a site and passes. Text that merely holds a name (a site
    `"slurm-gpu"`, a message "give a SLURM site") is prose, not a choice of system, and passes.
    """
    names, site_names = {n.lower() for n in names}, {n.lower() for n in site_names}
    parts = set(parts)
    offenders = []
    for module, tree in package.trees.items():
        if package.part(module) not in parts:
            continue
        skip = {id(d) for d in docstrings(tree)}
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        constants = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        for node in sorted(constants, key=lambda n: (n.lineno, n.col_offset)):
            if id(node) in skip:
                continue
            word = node.value.strip().lower()
            if word in names and (word not in site_names or _decides(node, parents)):
                offenders.append(f"{package.where(package.modules[module], node.lineno)}: {node.value!r}")
    return offenders


def _decides(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Whether this constant is compared, a dict key or a match case (what code chooses by)."""
    parent = parents.get(id(node))
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set)) and isinstance(parents.get(id(parent)), ast.Compare):
        return True
    return isinstance(parent, (ast.Compare, ast.MatchValue)) or isinstance(parent, ast.Dict) and node in parent.keys


def registry_names(tree: ast.Module, registry: str) -> list[str]:
    """The string keys of the module-level dict `registry` (the batch systems schedulers/ knows)."""
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else \
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id == registry and isinstance(node.value, ast.Dict):
            return [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return []
