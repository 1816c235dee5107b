"""compat.py: the one gate to other packages' private names, and its agreement with pyproject.toml."""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path

import pytest

from hpc_garage import compat
from hpc_garage.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_bounds_are_the_verified_ranges() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    specs = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower(): d for d in dependencies}
    for package, (low, high) in compat.VERIFIED.items():
        assert specs[package].replace(" ", "") == f"{package}>={low},<{high}", package


def test_installed_versions_are_verified() -> None:
    assert compat.uses_outside_range() == []
    assert all(compat.in_range(p) for p in compat.VERIFIED)


def test_every_use_names_a_verified_package() -> None:
    assert compat.USES and all(u.package in compat.VERIFIED for u in compat.USES)


@pytest.mark.parametrize(("installed", "inside"), [("0.3.7", True), ("0.3.99", True), ("0.4.0", False),
                                                   ("0.3.6", False), ("(not installed)", False)])
def test_range_edges(installed: str, inside: bool) -> None:
    assert compat.in_range("prefect-dask", installed) is inside


def test_a_missing_private_name_is_one_line_not_an_attribute_error() -> None:
    class NotARunner:
        pass

    with pytest.raises(compat.CompatError) as caught:
        compat.runner_started(NotARunner())
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert "prefect-dask" in message and "_started" in message and ">=0.3.7,<0.4.0" in message


def test_a_missing_private_coroutine_is_a_compat_error() -> None:
    with pytest.raises(compat.CompatError, match="_correct_state"):
        asyncio.run(compat.correct_state(object()))


def test_fallbacks_leave_behaviour_alone_outside_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    import distributed.utils

    monkeypatch.setattr(compat, "in_range", lambda package, installed=None: False)
    monkeypatch.setattr(distributed.utils, "_forkserver_preload_set", False, raising=False)
    assert compat.skip_forkserver_optional_preload() is False
    assert distributed.utils._forkserver_preload_set is False
    assert compat.stretch_no_tag_limits_cache(60.0) is False
