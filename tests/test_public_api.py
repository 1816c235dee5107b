"""The public API: `hpc_garage.__all__` is what docs/reference/api.md lists, each name loads, the package import
stays light, and the names an earlier README documented still work, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hpc_garage

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "api.md"


def _section(title: str) -> str:
    return PAGE.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_all_is_what_the_reference_page_lists() -> None:
    listed = re.findall(r"^\| `hpc_garage\.(\w+)` \|", _section("Public names"), re.MULTILINE)
    assert sorted(listed) == sorted(hpc_garage.__all__)
    documented = re.findall(r"^::: hpc_garage\.(\w+)$", PAGE.read_text(), re.MULTILINE)  # rendered by mkdocstrings
    assert sorted(documented) == sorted(hpc_garage.__all__)


def test_every_public_name_loads_and_says_why() -> None:
    from hpc_garage.cluster.handoff import Handoff, handoff_from_env
    from hpc_garage.compat import CompatError
    from hpc_garage.core.errors import SiteError, UserError

    assert (hpc_garage.Handoff, hpc_garage.handoff_from_env) == (Handoff, handoff_from_env)
    assert (hpc_garage.UserError, hpc_garage.SiteError, hpc_garage.CompatError) == (UserError, SiteError, CompatError)
    assert issubclass(hpc_garage.SiteError, hpc_garage.UserError) and issubclass(hpc_garage.CompatError, UserError)
    assert all(getattr(hpc_garage, name).__doc__ for name in hpc_garage.__all__)
    assert set(hpc_garage.__all__) <= set(dir(hpc_garage))
    with pytest.raises(AttributeError):
        hpc_garage.no_such_name  # noqa: B018


def test_the_package_import_stays_light() -> None:
    code = ("import sys, hpc_garage; hpc_garage.UserError, hpc_garage.handoff_from_env; "
            "print(sorted(m for m in ('prefect', 'distributed', 'dask', 'pydantic') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def _fresh(name: str) -> None:
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def test_the_readmes_old_handoff_import_works_and_warns() -> None:
    _fresh("hpc_garage.handoff")
    with pytest.warns(DeprecationWarning, match=r"hpc_garage\.handoff\.handoff_from_env is deprecated: it moved to "
                                                r"hpc_garage\.cluster\.handoff\.handoff_from_env; use "
                                                r"hpc_garage\.handoff_from_env\(\)") as caught:
        from hpc_garage.handoff import handoff_from_env
    assert handoff_from_env is hpc_garage.handoff_from_env
    assert caught[0].filename == __file__  # the warning points at the line that used the old name
    assert handoff_from_env(env={}) is None
    with pytest.warns(DeprecationWarning, match=r"hpc_garage\.handoff\.Handoff is deprecated"):
        assert importlib.import_module("hpc_garage.handoff").Handoff is hpc_garage.Handoff


def test_the_old_site_module_works_and_warns() -> None:
    _fresh("hpc_garage.site")
    import hpc_garage.site as old

    with pytest.warns(DeprecationWarning, match=r"hpc_garage\.site\.parse_site_dict is deprecated: it moved to "
                                                r"hpc_garage\.core\.site\.parse_site_dict"):
        from hpc_garage.core.site import parse_site_dict

        assert old.parse_site_dict is parse_site_dict


def test_old_names_are_only_the_moved_ones() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hpc_garage.no_such_module")  # the finder serves MOVED alone


def test_task_runner_imported_from_the_prefect_package_still_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the restructure `from hpc_garage.prefect import task_runner` gave the function; it gives the module
    now, and calling that module still gives the runner, with a DeprecationWarning."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from hpc_garage.prefect import task_runner
    from hpc_garage.prefect.task_runner import HpcTaskRunner

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # an API is configured: none is started
        with pytest.warns(DeprecationWarning, match=r"use hpc_garage\.task_runner\(\)") as caught:
            runner = task_runner(address="tcp://127.0.0.1:9")
        assert isinstance(runner, HpcTaskRunner) and caught[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the public spelling does not warn
            assert isinstance(hpc_garage.task_runner(address="tcp://127.0.0.1:9"), HpcTaskRunner)


def test_the_per_trial_api_is_what_the_reference_page_lists_and_works_outside_a_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hpc_garage.trial`: its `__all__` is the page's table, each name says why, its import is light, and
    outside hpc-garage it behaves as the page says (a local directory, nothing ever stops, report checks its
    arguments)."""
    from hpc_garage import trial

    listed = re.findall(r"^\| `hpc_garage\.trial\.(\w+)(?:\(.*?\))?` \|", _section("The per-trial API: `hpc_garage.trial`"),
                        re.MULTILINE)
    assert sorted(listed) == sorted(trial.__all__)
    assert all(getattr(trial, name).__doc__ for name in trial.__all__)
    code = ("import sys; from hpc_garage import trial; trial.should_stop(); "
            "print(sorted(m for m in ('prefect', 'distributed', 'dask', 'pydantic') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
    monkeypatch.chdir(tmp_path)
    for name in ("HPC_GARAGE_SWEEP", "HPC_GARAGE_RESULTS"):
        monkeypatch.delenv(name, raising=False)
    assert trial.should_stop() is False and trial.stop_reason() is None
    directory = trial.checkpoint_dir()
    assert directory.is_dir() and tmp_path in directory.resolve().parents
    trial.report(3, loss=0.5)  # outside a run: checked, kept nowhere
    with pytest.raises((ValueError, TypeError)):
        trial.report(-1, loss=0.5)
    with pytest.raises((ValueError, TypeError)):
        trial.report(1, loss=float("nan"))
    assert issubclass(trial.Interrupted, BaseException) and not issubclass(trial.Interrupted, Exception)
