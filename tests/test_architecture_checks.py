"""The architecture checks themselves (tests/architecture.py), each shown to fail on a few lines of synthetic
source, and to pass what it must pass: a check that cannot fail proves nothing about hpc_garage."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.architecture import Package, by_name_edges, import_time_offenders, layer_offenders, third_party_offenders
from tests.architecture_names import literal_offenders, private_offenders, registry_names, system_name_offenders


def package(tmp_path: Path, files: dict[str, str]) -> Package:
    """A package `pkg` under tmp_path with these files (path → source)."""
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return Package(root)


LAYERS = {"low": {"low"}, "mid": {"low", "mid"}, "top": {"low", "mid", "top"}, "__init__": {"__init__"}}


def test_an_import_up_the_layers_is_named_with_file_and_line(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"low/a.py": "import os\nfrom pkg.top import b\n", "top/b.py": "from pkg.low import a\n"})
    assert layer_offenders(pkg, LAYERS) == [
        "low reaches pkg.top.b: pkg/low/a.py:2 imports pkg.top.b"]


def test_a_lazy_import_counts(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"low/a.py": "def f():\n    import pkg.top.b\n", "top/b.py": ""})
    assert layer_offenders(pkg, LAYERS) == ["low reaches pkg.top.b: pkg/low/a.py:2 imports lazily pkg.top.b"]


def test_a_string_handed_to_a_loader_counts_and_prose_does_not(tmp_path: Path) -> None:
    pkg = package(tmp_path, {
        "low/a.py": '''\
            """Docstrings may name pkg.top.b."""
            PRELOAD = ("pkg.top.b",)  # a comment may name pkg.top.c
            ARGV = ["python", "-m", "pkg.top.c", "x.json"]
            CLASS = "pkg.top.d:Thing"
            HELP = "see pkg.top.e for more"
            ''',
        "top/b.py": "", "top/c.py": "", "top/d.py": "", "top/e.py": ""})
    assert layer_offenders(pkg, LAYERS) == [
        "low reaches pkg.top.b: pkg/low/a.py:2 names pkg.top.b",
        "low reaches pkg.top.c: pkg/low/a.py:3 names pkg.top.c",
        "low reaches pkg.top.d: pkg/low/a.py:4 names pkg.top.d"]


def test_reach_through_a_module_that_may_be_imported(tmp_path: Path) -> None:
    """`top` may import `mid.y` alone (as prefect/ may import cluster.handoff): what y reaches is top's reach."""
    layers = {**LAYERS, "other": {"low", "mid.y", "other"}}
    pkg = package(tmp_path, {
        "other/x.py": "from pkg.mid.y import f\n",
        "mid/y.py": "def f():\n    from pkg.mid import z\n",
        "mid/z.py": ""})
    assert layer_offenders(pkg, layers) == [
        "other reaches pkg.mid.z: pkg/other/x.py:1 imports pkg.mid.y → pkg/mid/y.py:2 imports lazily pkg.mid.z"]


def test_a_parent_packages_top_level_imports_count_and_its_lazy_ones_do_not(tmp_path: Path) -> None:
    """Importing pkg.low.sub.y runs pkg/low/sub/__init__.py: its top-level imports are the importer's reach."""
    pkg = package(tmp_path, {
        "low/sub/__init__.py": "import pkg.top.b\ndef later():\n    import pkg.top.c\n",
        "low/sub/y.py": "", "low/a.py": "import pkg.low.sub.y\n", "top/b.py": "", "top/c.py": ""})
    reached = pkg.reach("pkg.low.a")
    chain = "pkg/low/a.py:1 imports pkg.low.sub.y → pkg/low/sub/__init__.py:1 imports pkg.top.b"
    assert pkg.describe(reached["pkg.top.b"]) == chain
    assert "pkg.top.c" not in reached
    assert f"low reaches pkg.top.b: {chain}" in layer_offenders(pkg, LAYERS)


def test_a_declared_by_name_edge_is_not_followed_and_a_stale_one_is_reported(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"low/a.py": 'LOADED = "pkg.top.b.Thing"\n', "top/b.py": ""})
    assert layer_offenders(pkg, LAYERS, {"low.a": {"top.b"}}) == []
    assert by_name_edges(pkg, {"low.a": {"top.b"}}) == []
    assert by_name_edges(pkg, {"low.a": {"top.c"}}) == ["low.a → top.c"]


def test_import_circles_lazy_ones_included_type_checking_not(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"low/a.py": "import pkg.low.b\n", "low/b.py": "def f():\n    import pkg.low.a\n"})
    [circle] = pkg.cycles()
    assert pkg.describe(circle) == "pkg/low/a.py:1 imports pkg.low.b → pkg/low/b.py:2 imports lazily pkg.low.a"
    typing_only = package(tmp_path / "t", {
        "low/a.py": "import pkg.low.b\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.low.a\n"})
    assert typing_only.cycles() == []


PRIVATE = '''\
    import distributed
    import distributed._concurrent
    from distributed.scheduler import _helper, Scheduler
    from pkg.mine import _own_helper

    class Mine(Scheduler):
        def __init__(self):
            self._queue = []

        def use(self, other, names):
            self._queue.append(1)             # assigned in the package: its own
            self._started = True               # assigned here, so counted as its own (see the docstring)
            other._internal.run()              # another object's, never defined here
            _own_helper(self._inherited)      # inherited from Scheduler, never assigned here
            getattr(other, "_call")()
            return [hasattr(other, n) for n in ("_a", "_b")], other.__var__, other.__name__

    def touch():
        return distributed._queue, distributed.__version__  # distributed's own, though the name is ours too
    '''


def test_private_names_of_other_packages_are_found_generically(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"mod.py": PRIVATE, "mine.py": "def _own_helper(x):\n    return x\n"})
    found = {o.split(": ", 1)[1] for o in private_offenders(pkg, [])}
    assert found == {"imports distributed._concurrent", "imports _helper from distributed.scheduler", ".__var__",
                     "._internal", "._inherited", "getattr(…, '_call')", "hasattr(…, '_a')", "hasattr(…, '_b')",
                     "._queue"}
    assert "pkg/mod.py:14" in " ".join(private_offenders(pkg, []))  # file and line
    assert private_offenders(pkg, ["mod"]) == []  # the one module allowed (compat/)


def test_a_package_touching_only_its_own_private_names_passes(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"mod.py": '''\
        import sys
        from pkg.other import _helper

        class Thing:
            _cache = {}

            def __init__(self):
                self._items = []

            def add(self, other):
                other._items.extend(self._items)  # an object of this package: `_items` is defined here
                return _helper(sys._getframe(), type(self).__name__)
        ''', "other.py": "def _helper(*a):\n    return a\n"})
    assert private_offenders(pkg, []) == []


def test_literals_outside_their_home_are_found(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"names.py": 'SITE = "PKG_SITE"\n',
                             "use.py": '"""Docstrings may say PKG_SITE."""\nx = {"PKG_SITE": 1}  # PKG_SITE\n'})
    assert literal_offenders(pkg, r"PKG_[A-Z]+", lambda module, tree, line: module == "pkg.names") == [
        "pkg/use.py:2: 'PKG_SITE'"]


def test_heavy_imports_at_import_time_are_found_through_what_is_imported(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"cli.py": "import pkg.mid\ndef command():\n    import pkg.slow\n",
                             "mid.py": "import json\nimport prefect.flows\n", "slow.py": "import distributed\n"})
    assert import_time_offenders(pkg, "pkg.cli", ["prefect", "distributed"]) == [
        "pkg/mid.py:2: imports prefect.flows at import time (via pkg/cli.py:1 imports pkg.mid)"]
    assert third_party_offenders(pkg, ["slow"], ["distributed"]) == ["pkg/slow.py:1: imports distributed"]


def test_a_batch_system_name_is_found_where_code_decides_by_it(tmp_path: Path) -> None:
    pkg = package(tmp_path, {
        "low/systems.py": 'SYSTEMS = {"slurm": "low.slurm:Slurm", "pbs": "low.pbs:Pbs", "local": "low.local:Local"}\n',
        "top/a.py": '''\
            """Docstrings may say slurm."""
            def f(site, get):
                if site.scheduler == "slurm":  # compared
                    pass
                kind = get("PBS")  # held, in any case
                ok = site.scheduler in ("pbs", "local")  # what `in` searches
                default = site.name or "local"  # a site's name: passes
                prose = "submit to the slurm-gpu site on SLURM"  # text holding a name: passes
                return {"local": 1}  # a dict key
            '''})
    names = registry_names(pkg.trees["pkg.low.systems"], "SYSTEMS")
    assert names == ["slurm", "pbs", "local"]
    assert system_name_offenders(pkg, ["top"], names, ["local"]) == [
        "pkg/top/a.py:3: 'slurm'", "pkg/top/a.py:5: 'PBS'", "pkg/top/a.py:6: 'pbs'", "pkg/top/a.py:6: 'local'",
        "pkg/top/a.py:9: 'local'"]
    assert len(system_name_offenders(pkg, ["low"], names, ["local"])) == 3  # the registry's part spells them all


def test_an_http_client_import_is_found(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"low/a.py": "def f():\n    import httpx\n", "top/b.py": "from websockets import connect\n",
                             "mid/c.py": "import json\n"})
    assert third_party_offenders(pkg, ["low", "mid", "top"], ["httpx", "websockets"]) == [
        "pkg/low/a.py:2: imports httpx", "pkg/top/b.py:1: imports websockets"]
