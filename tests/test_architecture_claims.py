"""ARCHITECTURE.md's claims that tests/test_architecture.py does not hold itself, checked from the source.

- "What each part owns": every row names the tests that hold its "never" column (OWNERS below); a row the page
  adds without tests, or a named test that is gone, fails.
- "Who speaks to Prefect's API": the modules that import `hpc_garage.prefect_api` are exactly those the section
  names (a folder named there covers its modules), and every module it names exists.
- The logging rule (`log.py` in the module map): module loggers only, no root-logger calls, stderr prints only
  where listed (each a one-line refusal or a usage line of an entry point), `log.setup()` in each entry point.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hpc_garage"
ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text()

# each row of "What each part owns" -> the tests holding what it says the part never does (and owns alone)
OWNERS: dict[str, list[str]] = {
    "`core/`": ["tests/test_architecture.py::test_core_is_pure", "tests/test_architecture.py::test_reach_runs_one_way"],
    "`sites/`, `files.py`": ["tests/test_architecture.py::test_batch_system_spellings_only_in_schedulers",
                             "tests/test_architecture.py::test_no_batch_system_name_above_schedulers"],
    "`rundir.py`": ["tests/test_rundir.py::test_no_other_module_joins_a_run_root_and_a_job_id",
                    "tests/test_rundir.py::test_no_other_module_spells_a_name_in_the_run_directory",
                    "tests/test_architecture.py::test_batch_system_spellings_only_in_schedulers"],
    "`schedulers/`": ["tests/test_architecture.py::test_schedulers_never_start_dask",
                      "tests/test_architecture.py::test_batch_system_spellings_only_in_schedulers",
                      "tests/test_batch_system_plugin.py::test_show_script_renders_its_template",
                      "tests/test_batch_system_plugin.py::test_submit_hands_its_argv_to_it_and_records_the_job",
                      "tests/test_batch_system_plugin.py::test_status_is_parsed_by_it",
                      "tests/test_batch_system_plugin.py::test_the_job_reads_its_allocation_from_its_environment"],
    "`launchers/`": ["tests/test_architecture.py::test_reach_runs_one_way"],
    "`cluster/`": ["tests/test_architecture.py::test_only_the_prefect_side_imports_prefect",
                   "tests/test_architecture.py::test_reach_runs_one_way"],
    "`prefect/`": ["tests/test_architecture.py::test_reach_runs_one_way",
                   "tests/test_architecture.py::test_by_name_exceptions_are_current"],
    "`cli/`": ["tests/test_architecture.py::test_light_at_import"],
    "`compat/`": ["tests/test_architecture.py::test_private_names_of_other_packages_only_in_compat",
                  "tests/test_architecture.py::test_each_private_use_in_compat_is_declared",
                  "tests/test_architecture.py::test_reach_runs_one_way"],
}

# the only places a message goes to stderr by print: each a one-line refusal or usage line at an entry point
STDERR_PRINTS = {
    "prefect/refusals.py",  # the one line of a UserError that ends a flow's process (exit 2)
    "prefect/flow_run.py",  # its usage line, and the refusal's one line in a work-pool job
    "doctor/probe.py",  # the probe job's usage line (run outside `hpc-garage run`)
    "doctor/__main__.py",  # `python -m hpc_garage.doctor`'s usage line
    "sites/fields_gen.py",  # `--check`'s one line (a developer tool)
    "compat/versions.py",  # `python -m hpc_garage.compat`'s refusal
}
# log.py's "each entry point" list: module -> the function that calls setup()
ENTRY_POINTS = {"cluster/run.py": "run", "launchers/common.py": "run_entry", "prefect/server/keeper.py": None,
                "cli/server.py": "worker", "prefect/task_runner.py": "__enter__", "prefect/fast.py": None}


def _section(title: str) -> str:
    start = ARCHITECTURE.index(f"## {title}")
    end = ARCHITECTURE.find("\n## ", start + 3)
    return ARCHITECTURE[start:end]


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def _modules() -> dict[str, Path]:
    return {p.relative_to(PACKAGE).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_each_row_of_what_each_part_owns_is_held_by_tests() -> None:
    rows = [line.split("|")[1].strip() for line in _section("What each part owns").splitlines()
            if line.startswith("| `")]
    assert rows == list(OWNERS), "a row of 'What each part owns' without its tests here (or one gone)"
    for test in (t for tests in OWNERS.values() for t in tests):
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{test} is gone"


def _importers_of(module: str) -> set[str]:
    found = set()
    for name, path in _modules().items():
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.ImportFrom) and node.module == module) or (
                    isinstance(node, ast.Import) and any(a.name == module for a in node.names)):
                found.add(name)
    return found


def test_who_speaks_to_prefects_api_names_every_caller_of_the_one_client() -> None:
    section = _section("Who speaks to Prefect's API")
    named = set(re.findall(r"`((?:cluster|prefect|doctor|cli|launchers|schedulers)/[\w/]*(?:\.py)?)`", section))
    modules = _modules()
    for name in named:
        assert name in modules or (name.endswith("/") and any(m.startswith(name) for m in modules)), name

    def covered(module: str) -> bool:
        return module in named or any(n.endswith("/") and module.startswith(n) for n in named)

    callers = _importers_of("hpc_garage.prefect_api") - {"prefect_api.py"}
    assert callers and not {m for m in callers if not covered(m)}, "a caller of prefect_api.py the page misses"


def test_every_logger_is_its_modules_own_and_nothing_logs_through_the_root_logger() -> None:
    offenders = []
    for name, path in _modules().items():
        if name == "log.py":  # the one handler of the `hpc_garage` logger, every module's parent
            continue
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            target = node.func.value
            if isinstance(target, ast.Name) and target.id == "logging" and node.func.attr in (
                    "debug", "info", "warning", "error", "exception", "critical", "log"):
                offenders.append(f"{name}:{node.lineno}: logging.{node.func.attr}() (the root logger)")
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "logger" for t in node.targets)
                    and isinstance(node.value, ast.Call) and getattr(node.value.func, "attr", "") == "getLogger"):
                arg = node.value.args[0] if node.value.args else None
                own = (isinstance(arg, ast.Name) and arg.id == "__name__") or (
                    isinstance(arg, ast.Attribute) and ast.unparse(arg) == "__spec__.name") or (
                    isinstance(arg, ast.Constant) and arg.value == "hpc_garage." + name[:-3].replace("/", "."))
                if not own:
                    offenders.append(f"{name}:{node.lineno}: logger = {ast.unparse(node.value)}")
    assert not offenders, offenders


def test_stderr_prints_only_where_the_page_allows() -> None:
    printing = set()
    for name, path in _modules().items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" and any(
                    k.arg == "file" and "stderr" in ast.unparse(k.value) for k in node.keywords):
                printing.add(name)
    assert printing - STDERR_PRINTS == set(), "print to stderr outside a refusal or usage line: use a module logger"
    assert STDERR_PRINTS - printing == set(), "listed here, prints no more: take it off STDERR_PRINTS"


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_each_entry_point_the_page_names_calls_log_setup(module: str) -> None:
    tree = _tree(PACKAGE / module)
    where = ENTRY_POINTS[module]
    scope = tree if where is None else next(n for n in ast.walk(tree) if isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == where)
    names = {"log.setup"} | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                             and n.module == "hpc_garage.log" for a in n.names if a.name == "setup"}
    calls = {ast.unparse(n.func) for n in ast.walk(scope) if isinstance(n, ast.Call)}
    assert calls & names, f"{module}: {where or 'the module'} does not call hpc_garage.log.setup()"
