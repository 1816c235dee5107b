"""The shape of the code, checked from its source (cheap: nothing is imported).

- Batch-system spellings (`SLURM_*`/`PBS_*` variables, `#SBATCH`/`#PBS` directives, `select=`, `--gres=`,
  `ngpus=`, scontrol/squeue/qstat) appear in code only under `hpc_garage/schedulers/`.
- `hpc_garage/core/` is pure: it imports nothing of hpc-garage outside `core/`, and reads no environment,
  no files and no subprocess.
- Imports run one way: core <- (sites, files, variables) <- schedulers <- launchers <- cluster <- cli; prefect/ uses
  only core, the I/O helpers beside it and the handoff; compat is imported from anywhere and imports only core.
- Other packages' private names are touched only in `hpc_garage/compat.py`.
Docstrings and comments may name anything: only code (names, strings that are not docstrings) is read.
Each failure names the file and line.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hpc_garage"
SOURCES = sorted(PACKAGE.rglob("*.py"))

BATCH_SPELLINGS = re.compile(r"\b(SLURM_|SLURMD_|SBATCH_|PBS_)|#SBATCH|#PBS|\bselect=|--gres=|\bngpus=|"
                             r"\b(scontrol|squeue|qstat)\b")
IMPURE = re.compile(r"\bos\.environ\b|\bos\.getenv\b|\bexpandvars\b|\bsubprocess\b|\bopen\(|\.read_text\(|"
                    r"\.read_bytes\(|\.write_text\(|\bshutil\b|\bglob\(")

# which top-level parts of hpc_garage a part may import (its own included)
LAYERS = {
    "core": {"core"},
    "sites": {"core", "sites"},
    "files": {"core", "files"},
    "sweeps": {"core", "files", "sweeps"},
    "variables": {"core", "variables"},
    "compat": {"core"},
    "schedulers": {"core", "sites", "files", "sweeps", "variables", "schedulers", "compat"},
    "launchers": {"core", "sites", "files", "sweeps", "variables", "schedulers", "launchers", "compat"},
    "cluster": {"core", "sites", "files", "sweeps", "variables", "schedulers", "launchers", "cluster", "compat"},
    "prefect": {"core", "files", "variables", "prefect", "compat", "cluster.handoff"},
    "cli": {"core", "sites", "files", "sweeps", "variables", "schedulers", "launchers", "cluster", "prefect", "compat"},
    "__init__": {"prefect"},
    "__main__": {"cli"},
}


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _code_tokens(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every NAME and non-docstring STRING token: what the code itself says."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.add(first.lineno)
    tokens = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME or (tok.type == tokenize.STRING and tok.start[0] not in docstrings):
            tokens.append((tok.start[0], tok.string))
        elif tok.type == tokenize.FSTRING_MIDDLE if hasattr(tokenize, "FSTRING_MIDDLE") else False:
            tokens.append((tok.start[0], tok.string))
    return tokens


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Each line of code with comments and docstrings removed (for call patterns such as `open(`)."""
    lines: dict[int, str] = {}
    text = path.read_text()
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstring_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE) or tok.start[0] in docstring_lines:
            continue
        lines[tok.start[0]] = lines.get(tok.start[0], "") + tok.string
    return sorted(lines.items())


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (lazy imports count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "hpc_garage":
                found += [(node.lineno, f"hpc_garage.{alias.name}") for alias in node.names]
    return found


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{line}"


def test_batch_system_spellings_only_in_schedulers() -> None:
    offenders = [f"{_where(path, line)}: {text}" for path in SOURCES if _part(path) != "schedulers"
                 for line, text in _code_tokens(path) if BATCH_SPELLINGS.search(text)]
    assert not offenders, "batch-system spellings outside hpc_garage/schedulers/:\n" + "\n".join(offenders)


def test_core_is_pure() -> None:
    offenders = []
    for path in SOURCES:
        if _part(path) != "core":
            continue
        for line, module in _imports(path):
            if module.startswith("hpc_garage") and not module.startswith("hpc_garage.core"):
                offenders.append(f"{_where(path, line)}: imports {module}")
            if module.split(".")[0] in ("subprocess", "shutil", "glob", "socket", "distributed", "prefect"):
                offenders.append(f"{_where(path, line)}: imports {module}")
        offenders += [f"{_where(path, line)}: {text.strip()}" for line, text in _code_lines(path) if IMPURE.search(text)]
    assert not offenders, "hpc_garage/core/ must be pure:\n" + "\n".join(offenders)


def _allowed(part: str, target: str) -> bool:
    if target in ("", "__version__"):
        return True  # `from hpc_garage import __version__`
    name = target.split(".")[0]
    allowed = LAYERS[part]
    return name in allowed or target in allowed or any(target.startswith(a + ".") for a in allowed)


def test_imports_run_one_way() -> None:
    offenders = []
    for path in SOURCES:
        part = _part(path)
        for line, module in _imports(path):
            if not module.startswith("hpc_garage"):
                continue
            target = module.removeprefix("hpc_garage").lstrip(".")
            if target.startswith("resources") or target.startswith("task_runner"):
                continue
            if not _allowed(part, target):
                offenders.append(f"{_where(path, line)}: {part} imports hpc_garage.{target}")
    assert not offenders, "imports against the layering (see ARCHITECTURE.md):\n" + "\n".join(offenders)


PRIVATE_OF_OTHERS = re.compile(r"\b(_instances|_correct_state|_submit_job|_call|_new_worker_name|"
                               r"_update_worker_status|_forkserver_preload_set|_no_limits_cache|_cache_lock|"
                               r"_internal|_deployment_id|_deployment_parameters|_types_namespace|"
                               r"_optimize_futures|_job_id_from_submit_output|_i|_started|_cluster|__var__|valid_workers)\b")


OWN_NAMES = {"valid_workers"}  # placement.py's own method of that name (it replaces the scheduler's)


def test_private_names_of_other_packages_only_in_compat() -> None:
    offenders = []
    for path in SOURCES:
        if path.name == "compat.py":
            continue
        for line, text in _code_lines(path):
            for m in PRIVATE_OF_OTHERS.finditer(text):
                before = text[:m.start()]
                if before.endswith("def ") or (before.endswith("self.") and m.group(0) in OWN_NAMES):
                    continue
                offenders.append(f"{_where(path, line)}: {m.group(0)}")
    assert not offenders, "private names of other packages outside hpc_garage/compat.py:\n" + "\n".join(offenders)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_parses(path: Path) -> None:
    ast.parse(path.read_text(), str(path))
