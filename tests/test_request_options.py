"""The request options are written once, in core/request_options.py: `submit`'s and `show`'s flags, `sbatch`'s
spellings and help, the work pool's job variables (the run form) and the reference pages are compared with that
table here. Each comparison is a function of the table, so the last tests hand it a table one option longer, or
with one help text changed, and see every surface named."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_garage.core.request_options import BY_NAME, KINDS, OPTIONS, SHAPE, SHOW, RequestOption

ROOT = Path(__file__).resolve().parent.parent
NOT_REQUEST = {"submit": {"--dry-run", "--wait", "--help"}, "show": {"--json", "--script", "--worker-script", "--help"}}
SAMPLE = {"count": ("2", 2), "memory": ("8G", 8 * 2**30), "walltime": ("90", 5400), "text": ("abc", "abc"),
          "flag": (None, True)}  # a value as typed, and what the request then holds


def _command(name: str) -> click.Command:
    from hpc_garage.cli import cli

    command = cli.commands[name]
    assert isinstance(command, click.Command)
    return command


def cli_differences(table: tuple[RequestOption, ...], name: str, rows: tuple[str, ...] | None = None) -> list[str]:
    """What `hpc-garage NAME`'s click options say that the table does not (and the reverse)."""
    command = _command(name)
    wanted = [o for o in table if o.flags and (rows is None or o.name in rows)]
    params = {tuple(p.opts): p for p in command.params if isinstance(p, click.Option)}
    found = []
    for option in wanted:
        param = params.get(option.flags)
        if param is None:
            found.append(f"{name}: no option {'/'.join(option.flags)} ({option.name})")
        elif param.help != option.help:
            found.append(f"{name} {option.flag}: help {param.help!r}, the table's {option.help!r}")
        elif param.is_flag != (option.kind == "flag"):
            found.append(f"{name} {option.flag}: is_flag {param.is_flag}, the table's kind {option.kind}")
    known = {o.flags for o in wanted}
    found += [f"{name}: {opts[0]} is not in the table" for opts in params
              if opts not in known and opts[0] not in NOT_REQUEST[name]]
    return found


def pool_differences(table: tuple[RequestOption, ...]) -> list[str]:
    """What the work pool's template (the run form Prefect's UI builds, the job configuration) says otherwise."""
    from hpc_garage.prefect.job_variables import GarageVariables
    from hpc_garage.work_pool import HpcGarageWorker

    template = HpcGarageWorker.get_default_base_job_template()
    form = {k: v for k, v in template["variables"]["properties"].items() if k != "env"}
    defaults = GarageVariables().model_dump()
    found = []
    if list(form) != [o.name for o in table]:
        found.append(f"run form {list(form)}, the table's {[o.name for o in table]}")
    if set(template["job_configuration"]) - {"env"} != {o.name for o in table}:
        found.append(f"job configuration {sorted(template['job_configuration'])}")
    for option in table:
        field = form.get(option.name)
        if field is None:
            continue
        if field.get("description") != option.help:
            found.append(f"job variable {option.name}: description {field.get('description')!r}")
        if defaults.get(option.name) != option.default:
            found.append(f"job variable {option.name}: default {defaults.get(option.name)!r}")
        if option.title and field.get("title") != option.title:
            found.append(f"job variable {option.name}: title {field.get('title')!r}")
    return found


def _rows(page: str, heading: str | None = None) -> list[str]:
    text = (ROOT / "docs" / "reference" / page).read_text()
    if heading is not None:
        text = text.split(f"## `{heading}`\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in text.splitlines() if line.startswith("| `")]


def page_differences(table: tuple[RequestOption, ...]) -> list[str]:
    """What the reference pages (docs/reference/job-variables.md, cli.md's submit) say otherwise."""
    found = []
    variables = {re.match(r"\| `([^`]+)`", row).group(1): row.rsplit(" | ", 1)[1].removesuffix(" |")  # type: ignore[union-attr]
                 for row in _rows("job-variables.md")}
    for option in table:
        if variables.get(option.name) != option.help.replace("|", "\\|"):
            found.append(f"job-variables.md {option.name}: {variables.get(option.name)!r}")
    if set(variables) != {o.name for o in table}:
        found.append(f"job-variables.md lists {sorted(variables)}")
    submit = _rows("cli.md", "hpc-garage submit")
    for option in (o for o in table if o.flags):
        names = ", ".join(f"`{f}`" for f in option.flags)
        if not any(row.startswith(f"| {names}") and f"| {option.help}" in row for row in submit):
            found.append(f"cli.md submit: no row {names} with the table's help")
    return found


def sbatch_differences(table: tuple[RequestOption, ...]) -> list[str]:
    """Each option's sbatch spellings: read as `submit` reads the option, and named in `sbatch --help`."""
    from hpc_garage.schedulers.sbatch_options import parse

    help_text = _command("sbatch").help or ""
    found = []
    for option in (o for o in table if o.sbatch):
        typed, held = SAMPLE[option.kind]
        if "/".join(option.sbatch) not in help_text:
            found.append(f"sbatch --help: no {'/'.join(option.sbatch)}")
        for spelling in option.sbatch:
            try:
                call = parse([spelling, *([typed] if typed is not None else []), "flow.py"])
            except Exception as exc:  # noqa: BLE001 - a spelling sbatch does not take is the finding
                found.append(f"sbatch {spelling}: {exc}")
                continue
            got = getattr(call.request(), option.field) if option.field else getattr(call, option.name)
            if got != held or call.script != "flow.py":
                found.append(f"sbatch {spelling} {typed}: {got!r}, not {held!r}")
    return found


# ---------------------------------------------------------------------------------------------- the table


def test_the_cli_flags_are_the_tables() -> None:
    assert cli_differences(OPTIONS, "submit") == []
    assert cli_differences(OPTIONS, "show", SHOW) == []


def test_the_work_pools_job_variables_are_the_tables() -> None:
    assert pool_differences(OPTIONS) == []


def test_the_reference_pages_are_the_tables() -> None:
    assert page_differences(OPTIONS) == []


def test_sbatch_reads_each_spelling_as_submit_reads_the_option() -> None:
    assert sbatch_differences(OPTIONS) == []


def test_a_job_variable_is_read_as_its_row_says() -> None:
    from hpc_garage.schedulers.flow_run_jobs import VARIABLES, request_of

    assert VARIABLES == tuple(o.name for o in OPTIONS)
    values: dict[str, Any] = {"site": "lab-gpu", "scheduler_options": ["--constraint=x"]}
    values |= {o.name: SAMPLE[o.kind][0] if o.kind != "flag" else True for o in OPTIONS
               if o.name not in values and o.kind != "directives"}
    site, request, sweep, resume = request_of(values)
    assert (site, sweep, resume) == ("lab-gpu", "abc", True)
    for option in OPTIONS:
        if option.field and option.kind in SAMPLE:
            assert getattr(request, option.field) == SAMPLE[option.kind][1], option.name
    assert request.extra_directives == ("--constraint=x",)


@given(st.sampled_from([o for o in OPTIONS if o.kind == "count"]), st.integers(0, 10**6))
def test_a_count_reads_as_a_number_or_its_digits(option: RequestOption, n: int) -> None:
    assert option.read(n) == option.read(str(n)) == option.read(f" {n} ") == n


@pytest.mark.parametrize("option,value,words", [
    (BY_NAME["nodes"], "two", "give a whole number (submit's --nodes)"),
    (BY_NAME["nodes"], True, "give a whole number"),
    (BY_NAME["resume"], "yes", "give true or false (submit's --resume)"),
    (BY_NAME["account"], 3, "give text (submit's --account)"),
    (BY_NAME["scheduler_options"], "--exclusive", "give a list"),
    (BY_NAME["scheduler_options"], ["ok", " "], "give a list"),
    (BY_NAME["mem"], "lots", "is not a memory size"),
    (BY_NAME["time"], "soon", "soon"),
])
def test_a_value_a_row_cannot_read_is_refused_in_words(option: RequestOption, value: Any, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        option.read(value)


def test_unset_and_empty_mean_the_sites_default() -> None:
    assert all(o.read(None) is None and o.read("") is None for o in OPTIONS)
    assert BY_NAME["mem"].read("0") is None  # sbatch's --mem=0: the whole node
    with pytest.raises(ValueError, match="kind 'size'"):
        RequestOption("x", "size", "X.")
    assert {o.kind for o in OPTIONS} <= set(KINDS)


# ------------------------------------------------------------------ the comparisons catch a drifted table


def test_an_option_missing_anywhere_fails_every_comparison() -> None:
    table = (*OPTIONS, RequestOption("reservation", "text", "A reservation.", ("--reservation",), ("--reservation",),
                                     "queue"))
    for found in (cli_differences(table, "submit"), pool_differences(table), page_differences(table),
                  sbatch_differences(table)):
        assert any("reservation" in line for line in found), found


def test_another_help_text_anywhere_fails_every_comparison_that_shows_help() -> None:
    table = tuple(replace(o, help="Nodes, however many.") if o.name == "nodes" else o for o in OPTIONS)
    for found in (cli_differences(table, "submit"), cli_differences(table, "show", SHOW), pool_differences(table),
                  page_differences(table)):
        assert any("nodes" in line for line in found), found
    assert sbatch_differences(table) == []  # sbatch's help names the spellings, not each option's text
