"""The shape of the code, checked from its source (cheap: nothing is imported). Each failure names file and line.

Every claim ARCHITECTURE.md makes about the code is checked here:
- the layers: what each part may import, read from ARCHITECTURE.md's "Allowed imports" table and held equal
  to `LAYERS`, checked on everything a module reaches (lazy imports, strings handed to a loader, and what its
  imports import in turn; `tests/architecture.py` says exactly what counts); no import circles;
- batch-system spellings (`SLURM_*`/`PBS_*` variables, `#SBATCH`/`#PBS` directives, `select=`, `--gres=`,
  `ngpus=`, scontrol/squeue/qstat) only under `hpc_garage/schedulers/`, and no batch system's name (`"slurm"`,
  `"pbs"`; `"local"` where code decides by it) above it: the rest asks a system what it can do;
- `core/` (and the jobqueue scaling policy) pure: no environment, files, subprocess;
- Prefect's package imported only by `prefect/` and `compat/`, and its clients (httpx, websockets) too;
  `prefect_api.py` on the standard library alone; Dask never started by `schedulers/`; the CLI's,
  `sites/view.py`'s and the package's import light;
- other packages' private names only in `compat/` (one module per package), each use there declared with `@uses`;
- every `HPC_GARAGE_*` name spelled once: in `variables.py` (or, for the one core writes, `core/variable_names.py`,
  which variables.py re-exports);
- the module map names every module, and only modules that exist.
The checks themselves are shown to fail on small synthetic packages at the end.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.architecture import (Package, by_name_edges, code_lines, code_tokens, import_time_offenders,
                                layer_offenders, third_party_offenders)
from tests.architecture_names import (constant_definitions, literal_offenders, private_offenders, private_uses,
                                      registry_names, system_name_offenders)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hpc_garage"
SOURCES = sorted(PACKAGE.rglob("*.py"))
HPC = Package(PACKAGE)

BATCH_SPELLINGS = re.compile(r"\b(SLURM_|SLURMD_|SBATCH_|PBS_)|#SBATCH|#PBS|\bselect=|--gres=|\bngpus=|"
                             r"\b(scontrol|squeue|qstat)\b")
IMPURE = re.compile(r"\bos\.environ\b|\bos\.getenv\b|\bexpandvars\b|\bsubprocess\b|\bopen\(|\.read_text\(|"
                    r"\.read_bytes\(|\.write_text\(|\bshutil\b|\bglob\(")

# What each part may reach besides itself and EVERYWHERE. A dotted entry (`cluster.handoff`) allows that module
# alone, and what it reaches counts as the importer's own reach. ARCHITECTURE.md's table says the same (checked).
FLOOR = {"core", "variables", "log", "files", "rundir", "sites", "sweeps"}
PREFECT_SIDE = {"core", "variables", "log", "files", "rundir", "prefect_api", "compat", "cluster.handoff",
                "cluster.stopping", "schedulers.job_env", "pruning"}
LAYERS: dict[str, set[str]] = {
    "core": set(),
    "_version": set(),
    "variables": {"core"},
    "log": set(),
    "files": {"core"},
    "rundir": {"core", "variables", "files"},
    "prefect_api": {"core", "variables", "log"},
    "sites": {"core", "variables"},
    "sweeps": {"core", "files"},
    "compat": {"core.errors"},
    "pruning": {"core", "variables"},  # Optuna's pruners for task_runner(pruner=...); imports optuna lazily
    "schedulers": FLOOR | {"compat"},
    "launchers": FLOOR | {"compat", "schedulers"},
    "cluster": FLOOR | {"compat", "schedulers", "launchers", "prefect_api"},
    "prefect": PREFECT_SIDE,
    # `hpc-garage doctor`: above `run` (it submits and follows a job), and the managed server (lazily)
    "doctor": FLOOR | {"compat", "schedulers", "launchers", "prefect_api", "cluster", "prefect"},
    # the `hpc-garage` work-pool type Prefect loads (entry point): prefect/pool_worker.py + schedulers/flow_run_jobs.py
    "work_pool": FLOOR | {"compat", "schedulers", "prefect_api", "cluster.handoff", "cluster.stopping", "pruning",
                          "prefect"},
    "cli": FLOOR | {"compat", "schedulers", "launchers", "prefect_api", "cluster", "pruning", "prefect", "work_pool",
                    "doctor"},
    "__init__": PREFECT_SIDE | {"prefect", "tuning"},  # the package root: resources(), task_runner(), search()
    "trial": PREFECT_SIDE | {"prefect"},  # the per-trial API: checkpoint_dir(), should_stop(), Interrupted
    "tuning": PREFECT_SIDE | {"prefect"},  # hpc_garage.search: Optuna's ask and tell over the job's workers
}
LAYERS["__main__"] = LAYERS["cli"] | {"cli"}  # `python -m hpc_garage`: the CLI
# Dotted names a module spells without loading them (or for a loader elsewhere): not followed as its reach; the
# named module's own reach is checked as its part's. Each says why; one the code no longer has fails the test.
BY_NAME_ONLY = {
    # prefect-dask builds the login-node cluster from this name, only where no `run` handed a cluster over
    "prefect.task_runner": {"cluster.local"},
    # the job script shows, as a comment, the line `run` starts dask-mpi's ranks with; nothing loads it there
    "schedulers.jobscript": {"launchers.dask_mpi"},
}
EVERYWHERE = {"_version"}  # imports nothing; the package root imports it, and every import runs the root


# ------------------------------------------------------------------------------------------ layers


def _doc_layers() -> dict[str, set[str]]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Allowed imports", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            table[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return table


def _doc_by_name() -> dict[str, set[str]]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Allowed imports", 1)[1].split("\n## ", 1)[0]
    found: dict[str, set[str]] = {}
    for source, target in re.findall(r"`([\w.]+)` names\s+`([\w.]+)` by its dotted name", section):
        found.setdefault(source, set()).add(target)
    return found


def test_architecture_md_states_the_layers_checked_here() -> None:
    doc = _doc_layers()
    differ = {part: (doc.get(part), LAYERS.get(part)) for part in set(doc) | set(LAYERS)
              if doc.get(part) != LAYERS.get(part)}
    assert not differ, f"ARCHITECTURE.md's Allowed imports (left) and LAYERS here (right) differ: {differ}"
    assert _doc_by_name() == BY_NAME_ONLY, "ARCHITECTURE.md and BY_NAME_ONLY name different loader-only names"


def test_every_part_has_a_layer() -> None:
    parts = {HPC.part(m) for m in HPC.modules}
    assert parts <= set(LAYERS), f"parts without a row in ARCHITECTURE.md's Allowed imports: {parts - set(LAYERS)}"


def test_reach_runs_one_way() -> None:
    offenders = layer_offenders(HPC, LAYERS, BY_NAME_ONLY, EVERYWHERE)
    assert not offenders, "reach against the layering (ARCHITECTURE.md, Allowed imports):\n" + "\n".join(offenders)


def test_by_name_exceptions_are_current() -> None:
    stale = by_name_edges(HPC, BY_NAME_ONLY)
    assert not stale, f"BY_NAME_ONLY names what the code no longer names: {stale}"


def test_no_import_circles() -> None:
    circles = [HPC.describe(c) for c in HPC.cycles()]
    assert not circles, "import circles (lazy imports included):\n" + "\n".join(circles)


def test_batch_system_spellings_only_in_schedulers() -> None:
    offenders = [f"{HPC.where(path, line)}: {text}" for path in SOURCES if HPC.part(_module(path)) != "schedulers"
                 for line, text in code_tokens(path) if BATCH_SPELLINGS.search(text)]
    assert not offenders, "batch-system spellings outside hpc_garage/schedulers/:\n" + "\n".join(offenders)


# The site model and its plain mirror (core/site.py, sites/) sit below schedulers/ and spell the names a site
# file's `scheduler:` may take; everything above asks a batch system what it can do (schedulers/base.py).
NAMES_SPELLED = {"schedulers"}
SYSTEMS_TABLE = "hpc_garage.core.site_values"  # the site model's mirror of the registry: names and capabilities
SITE_NAMED_LIKE_A_SYSTEM = ["local"]  # the default site is called `local`: `name or "local"` names a site


def test_no_batch_system_name_above_schedulers() -> None:
    names = registry_names(HPC.trees["hpc_garage.schedulers"], "_SYSTEMS")
    assert {"slurm", "pbs", "local"} <= set(names), f"schedulers/__init__.py's _SYSTEMS lists {names}"
    parts = {HPC.part(m) for m in HPC.modules} - NAMES_SPELLED
    assert {"core", "sites", "launchers", "cluster", "cli", "doctor", "prefect"} <= parts
    offenders = [o for o in system_name_offenders(HPC, parts, names, SITE_NAMED_LIKE_A_SYSTEM)
                 if not o.startswith(HPC.where(HPC.modules[SYSTEMS_TABLE], 0).rsplit(":", 1)[0] + ":")]
    assert not offenders, ("a batch system's name outside schedulers/ (ask the system what it can do: "
                           "schedulers/base.py's capabilities):\n" + "\n".join(offenders))


def _module(path: Path) -> str:
    return next(name for name, p in HPC.modules.items() if p == path)


def _impure(paths: list[Path]) -> list[str]:
    offenders = []
    for path in paths:
        for line, text in code_lines(path):
            if IMPURE.search(text):
                offenders.append(f"{HPC.where(path, line)}: {text.strip()}")
    return offenders


def test_core_is_pure() -> None:
    core = [p for p in SOURCES if HPC.part(_module(p)) == "core"]
    offenders = third_party_offenders(HPC, ["core"], ["subprocess", "shutil", "glob", "socket", "distributed",
                                                      "prefect"])
    offenders += [f"{HPC.where(p, line)}: imports {m}" for p in core for line, m in _own_imports(p)
                  if not m.startswith("hpc_garage.core")]
    offenders += _impure(core)
    assert not offenders, "hpc_garage/core/ must be pure:\n" + "\n".join(offenders)


def _own_imports(path: Path) -> list[tuple[int, str]]:
    module = _module(path)
    return [(e.line, e.target) for e in HPC.edges(module)]


def test_the_scaling_policy_is_pure() -> None:
    path = PACKAGE / "launchers" / "jobqueue" / "scaling.py"
    offenders = _impure([path]) + [f"{HPC.where(path, line)}: imports {m}" for line, m in _own_imports(path)
                                   if not m.startswith("hpc_garage.core")]
    assert not offenders, "launchers/jobqueue/scaling.py is pure policy:\n" + "\n".join(offenders)


# ---------------------------------------------------------------------- third-party packages by part


def test_only_the_prefect_side_imports_prefect() -> None:
    others = {HPC.part(m) for m in HPC.modules} - {"prefect", "compat"}
    offenders = third_party_offenders(HPC, others, ["prefect", "prefect_dask"])
    assert not offenders, "Prefect's package outside prefect/ and compat/:\n" + "\n".join(offenders)


@pytest.mark.parametrize("part", ["prefect_api", "log", "_version"])
def test_standard_library_alone(part: str) -> None:
    """The Prefect client (urllib: importable where Prefect is not) and the log handler import nothing else."""
    offenders = [o for o in third_party_offenders(HPC, [part], _imported_top_names(part))
                 if o.rsplit(" ", 1)[-1].split(".")[0] not in sys.stdlib_module_names | {"hpc_garage", "__future__"}]
    assert not offenders, f"{part} imports beyond the standard library:\n" + "\n".join(offenders)


def test_one_client_speaks_http() -> None:
    """Every HTTP call hpc-garage makes itself goes through prefect_api.py (one auth header, one proxy policy)."""
    others = {HPC.part(m) for m in HPC.modules} - {"prefect_api"}
    offenders = third_party_offenders(HPC, others, ["urllib.request", "http.client", "requests", "urllib3"])
    assert not offenders, "HTTP outside prefect_api.py:\n" + "\n".join(offenders)


# Prefect's own clients (httpx, websockets) run in the flow: prefect/ may handle what they raise; hpc-garage's own
# HTTP goes through prefect_api.py (standard library), so nothing else imports them.
PREFECT_CLIENTS_ALLOWED = {"prefect", "compat"}


def test_prefect_clients_only_on_the_flow_side() -> None:
    others = {HPC.part(m) for m in HPC.modules} - PREFECT_CLIENTS_ALLOWED
    offenders = third_party_offenders(HPC, others, ["httpx", "websockets"])
    assert not offenders, "httpx/websockets outside prefect/ and compat/:\n" + "\n".join(offenders)


def _imported_top_names(part: str) -> set[str]:
    names = set()
    for module, tree in HPC.trees.items():
        if HPC.part(module) == part:
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return names


def test_schedulers_never_start_dask() -> None:
    offenders = third_party_offenders(HPC, ["schedulers"], ["distributed", "dask_jobqueue", "dask_mpi"])
    assert not offenders, "Dask in schedulers/:\n" + "\n".join(offenders)


HEAVY = ["prefect", "prefect_dask", "distributed", "dask", "dask_jobqueue", "pydantic", "httpx"]


@pytest.mark.parametrize("module", ["hpc_garage.cli", "hpc_garage", "hpc_garage.sites.view"])
def test_light_at_import(module: str) -> None:
    """The CLI imports heavy packages only in the command that needs them; the package itself and the site view
    (which `show` uses to lay out plain sites without pydantic) import none."""
    offenders = import_time_offenders(HPC, module, HEAVY)
    assert not offenders, f"{module} imports heavy packages when imported:\n" + "\n".join(offenders)


# ---------------------------------------------------------------------------------- private names


COMPAT = sorted(m for m in HPC.modules if HPC.part(m) == "compat")  # hpc_garage/compat/: one module per package


def test_private_names_of_other_packages_only_in_compat() -> None:
    offenders = private_offenders(HPC, [m.split(".", 1)[1] for m in COMPAT])
    assert not offenders, "private names of other packages outside hpc_garage/compat/:\n" + "\n".join(offenders)


# the names found outside compat/ once (before the generic check above): kept out by name as well
PRIVATE_OF_OTHERS = re.compile(r"\b(_instances|_correct_state|_submit_job|_call|_new_worker_name|"
                               r"_update_worker_status|_forkserver_preload_set|_no_limits_cache|_cache_lock|"
                               r"_internal|_deployment_id|_deployment_parameters|_types_namespace|"
                               r"_optimize_futures|_job_id_from_submit_output|_i|_started|_cluster|__var__|valid_workers)\b")
OWN_NAMES = {"valid_workers"}  # placement.py's own method of that name (it replaces the scheduler's)


def test_known_private_names_of_other_packages_only_in_compat() -> None:
    offenders = []
    for path in SOURCES:
        if _module(path) in COMPAT:
            continue
        for line, text in code_lines(path):
            for m in PRIVATE_OF_OTHERS.finditer(text):
                before = text[:m.start()]
                if before.endswith("def ") or (before.endswith("self.") and m.group(0) in OWN_NAMES):
                    continue
                offenders.append(f"{HPC.where(path, line)}: {m.group(0)}")
    assert not offenders, "private names of other packages outside hpc_garage/compat/:\n" + "\n".join(offenders)


def test_each_private_use_in_compat_is_declared() -> None:
    """compat/'s functions that touch another package's private names say so with `@uses(package, what)` (a
    private helper of theirs, `_name`, is covered by its callers' declarations; the standard library's own,
    which have no verified range, are not declared)."""
    assert len(COMPAT) > 1, f"hpc_garage/compat/ is one module per package: {COMPAT}"
    undeclared = [f"{HPC.where(HPC.modules[module], node.lineno)}: {node.name}" for module in COMPAT
                  for node in HPC.trees[module].body
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _declares_use(node)
                  and private_uses(HPC, module, node, ignore=sys.stdlib_module_names)]
    assert not undeclared, "compat/ functions using private names without @uses:\n" + "\n".join(undeclared)


def _declares_use(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "uses"
               for d in node.decorator_list) or node.name.startswith("_")


# ------------------------------------------------------------------------------ HPC_GARAGE_* names

VARIABLE = r"HPC_GARAGE_[A-Z0-9_]+"
NAME_HOMES = {"hpc_garage.variables", "hpc_garage.core.variable_names"}


def _defines_variable(module: str, tree: ast.Module, line: int) -> bool:
    """An HPC_GARAGE_* literal may only be the value of a module-level constant of its two homes."""
    return module in NAME_HOMES and any(at == line for at, _ in constant_definitions(tree, VARIABLE).values())


def test_each_variable_name_is_spelled_in_its_home_only() -> None:
    offenders = literal_offenders(HPC, VARIABLE, _defines_variable)
    assert not offenders, ("HPC_GARAGE_* spelled outside hpc_garage/variables.py (use its constant; core's "
                           "own in core/variable_names.py):\n" + "\n".join(offenders))


def test_each_variable_is_defined_once_and_variables_names_them_all() -> None:
    defined: dict[str, list[str]] = {}
    for module in NAME_HOMES:
        for name, (line, value) in constant_definitions(HPC.trees[module], VARIABLE).items():
            defined.setdefault(value, []).append(f"{HPC.where(HPC.modules[module], line)} {name}")
    twice = {value: where for value, where in defined.items() if len(where) > 1}
    assert not twice, f"HPC_GARAGE_* names defined more than once: {twice}"
    core_names = set(constant_definitions(HPC.trees["hpc_garage.core.variable_names"], VARIABLE))
    reexported = {a.name for node in ast.walk(HPC.trees["hpc_garage.variables"]) if isinstance(node, ast.ImportFrom)
                  and node.module == "hpc_garage.core.variable_names" for a in node.names}
    assert core_names <= reexported, f"variables.py does not re-export core's {core_names - reexported}"


# ------------------------------------------------------------------------------------- the module map


def test_the_module_map_names_every_module() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    text = re.sub(r"\b(tests|bench|scripts)/[\w/]+\.py", "", text)  # the tests' and tools' own files
    named = set(re.findall(r"(?<![\w.-])([a-z_][a-z0-9_]*\.py)\b", text))
    files = {p.name for p in SOURCES if p.name not in ("__init__.py", "__main__.py")}
    assert files <= named, f"modules ARCHITECTURE.md does not name: {sorted(files - named)}"
    exist = files | {"__init__.py"} | {p.name for p in ROOT.glob("jobscripts/*.py")}  # the job scripts named too
    assert named <= exist, f"ARCHITECTURE.md names modules that do not exist: {sorted(named - exist)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_parses(path: Path) -> None:
    ast.parse(path.read_text(), str(path))
