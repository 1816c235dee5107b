"""variables.py: each `HPC_GARAGE_*` value read and checked in one place, a bad one refused in one line that names
the variable, its value and what would do (that each name is spelled only there is tests/test_architecture.py)."""

from __future__ import annotations

import re

import pytest

from hpc_garage import variables
from hpc_garage.core import variable_names
from hpc_garage.core.errors import UserError
from hpc_garage.variables import modules, seconds, switch

NAME = "HPC_GARAGE_TEST_SECONDS"


@pytest.mark.parametrize("text, value", [("180", 180.0), (" 2.5 ", 2.5), ("604800", 604800.0)])
def test_seconds_are_read(text: str, value: float) -> None:
    assert seconds({NAME: text}, NAME, 60) == value


@pytest.mark.parametrize("env", [{}, {NAME: ""}, {NAME: "  "}])
def test_unset_or_empty_seconds_are_the_default(env: dict[str, str]) -> None:
    assert seconds(env, NAME, 60) == 60


@pytest.mark.parametrize("text", ["abc", "nan", "inf", "-1", "0", "604801", "1e9"])
def test_bad_seconds_are_one_line_naming_the_variable_and_an_example(text: str) -> None:
    with pytest.raises(UserError) as refused:
        seconds({NAME: text}, NAME, 60)
    message = str(refused.value)
    assert message.startswith(f"{NAME}={text!r}: give seconds") and f"e.g. {NAME}=180" in message
    assert "\n" not in message


@pytest.mark.parametrize("text, on", [("1", True), ("TRUE", True), ("yes", True), (" on ", True),
                                      ("0", False), ("False", False), ("no", False), ("off", False)])
def test_switches_read_the_usual_words(text: str, on: bool) -> None:
    assert switch({NAME: text}, NAME, not on) is on


def test_a_switch_may_take_more_words_for_off_and_refuses_the_rest() -> None:
    assert switch({}, NAME, True) is True and switch({NAME: ""}, NAME, False) is False
    assert switch({NAME: "dask"}, NAME, True, also_no=("dask",)) is False
    with pytest.raises(UserError, match=rf"^{NAME}='maybe': give 1 or 0 \(true/false, yes/no, on/off\)$"):
        switch({NAME: "maybe"}, NAME, True)


def test_modules_are_a_checked_comma_separated_list() -> None:
    assert modules({}, NAME) is None
    assert modules({NAME: ""}, NAME) == []
    assert modules({NAME: " json, distributed ,"}, NAME) == ["json", "distributed"]
    with pytest.raises(UserError, match=rf"^{NAME}='json,no_such_module_here': module 'no_such_module_here' is not "
                                        rf"installed here; fix the list .* or unset {NAME}$"):
        modules({NAME: "json,no_such_module_here"}, NAME)


def test_every_name_is_an_hpc_garage_variable_and_none_is_named_twice() -> None:
    names = {k: v for k, v in vars(variables).items() if k.isupper() and isinstance(v, str) and k not in ("_YES", "_NO")}
    assert names and all(re.fullmatch(r"HPC_GARAGE_[A-Z0-9_]+", v) for v in names.values()), names
    assert len(set(names.values())) == len(names), "two names for one variable"
    assert variables.CPUS_ENV == variable_names.CPUS_ENV  # the one core writes, re-exported
    assert {"SITE_ENV", "SCHEDULER_FILE_ENV", "JOB_ID_ENV", "RUN_DIR_ENV", "START_TIMEOUT", "PLACEMENT",
            "WORKER_PRELOAD", "SYSFS_ROOT_ENV", "SITES_PATH_ENV", "POOL_RESOURCES_ENV"} <= set(names)
