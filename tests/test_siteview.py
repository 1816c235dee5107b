"""The pydantic-free site loader of `show`: it must accept exactly what the pydantic models accept, with the
same values, and hand everything else (errors included) to pydantic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from hpc_garage.sites import view as siteview
from hpc_garage.core.errors import SiteError
from hpc_garage.core.site import JobqueueSettings, Limits, MpiSettings, NodeShape, Site, WorkerLayout
from hpc_garage.sites import load_site
from hpc_garage.sites.files import packaged_dir
from hpc_garage.sites.view import SiteView


def _defaults(model: type[BaseModel]) -> list[tuple[str, Any]]:
    out = []
    for name, f in model.model_fields.items():
        if f.is_required():
            out.append((name, siteview.REQUIRED))
        else:
            default = f.get_default(call_default_factory=True)
            out.append((name, default.model_dump(mode="json") if isinstance(default, BaseModel) else default))
    return out


@pytest.mark.parametrize("table, model", [(siteview.NODE, NodeShape), (siteview.WORKERS, WorkerLayout),
                                          (siteview.LIMITS, Limits), (siteview.MPI, MpiSettings)])
def test_tables_have_the_models_fields_order_and_defaults(table: list, model: type[BaseModel]) -> None:
    assert [(name, default) for name, default, _ in table] == _defaults(model)


def test_site_table_matches_the_site_model() -> None:
    expected = [(n, d) for n, d in _defaults(Site) if n != "path"]
    ours = [(n, d) for n, d, _ in siteview.SITE]
    assert [n for n, _ in ours] == [n for n, _ in expected]
    sections = {"workers", "limits", "mpi", "jobqueue", "pools"}  # defaults that are (dumped) models, checked above
    assert [x for x in ours if x[0] not in sections] == [x for x in expected if x[0] not in sections]
    assert siteview.JOBQUEUE_DEFAULTS == JobqueueSettings().model_dump(mode="json")


def _same(view: SiteView, site: Site) -> None:
    # compared as JSON text: `True == 1` in Python, not in a plan's JSON
    assert json.dumps(view.model_dump(mode="json")) == json.dumps(site.model_dump(mode="json"))
    assert view.path == site.path and view.raw == site.raw and view.gpu_env_vars == site.gpu_env_vars
    for section in ("node", "workers", "limits", "mpi"):
        for name in type(getattr(site, section)).model_fields:
            assert getattr(getattr(view, section), name) == getattr(getattr(site, section), name)


def test_every_shipped_mpi_site_takes_the_fast_path_with_the_same_values() -> None:
    fast = 0
    for path in sorted(packaged_dir("site-configs").glob("*.yaml")):
        loaded, site = siteview.load(path), load_site(path)
        if site.launcher == "jobqueue":
            assert isinstance(loaded, Site)
            continue
        assert isinstance(loaded, SiteView), path
        _same(loaded, site)
        assert loaded.full() == site
        fast += 1
    assert fast >= 6


def test_errors_are_pydantics(site_dir: Path) -> None:
    (site_dir / "bad.yaml").write_text("scheduler: slurm\nnode: {cores: 4, memroy: 8GiB}\n")
    with pytest.raises(SiteError) as fast:
        siteview.load("bad")
    with pytest.raises(SiteError) as slow:
        load_site("bad")
    assert str(fast.value) == str(slow.value) and "did you mean 'memory'" in str(fast.value)


# ------------------------------------------------------------------------------- generated site files



def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid ~29 times in 30 (one_of picks its branches evenly): a file is accepted only if all its values are."""
    return st.sampled_from([True] * 29 + [False]).flatmap(lambda ok: valid if ok else invalid)


ODD = st.sampled_from([0, -1, True, False, 4.0, 2.5, "4", " 8", "many", None, [], {}, "auto", "64GiB"])
ODD_INT = st.sampled_from([0, -1, True, 4.0, "4"])
INTS = mostly(st.integers(1, 64), st.one_of(ODD_INT, ODD))
TEXTS = mostly(st.one_of(st.text(max_size=6), st.none()), st.sampled_from([0, 3, 2.5, True, [], {"a": 1}]))
BIG_MEMORY = mostly(st.one_of(st.sampled_from(["64GiB", "512GiB", "2gb", "8G", "16 GB", "1.5GiB", "96000MB"]),
                              st.integers(2**31, 2**40).map(lambda n: f"{n}B")),
                    st.sampled_from(["256", "lots", "0B", 0, 64, None, True, [1], "-1GiB", "1.5"]))
SMALL_MEMORY = mostly(st.sampled_from(["0B", "512MiB", "1GiB", "1gb", "100 MB"]),
                      st.sampled_from(["256", "lots", 0, 64, None, True, "-1GiB", "99TiB", 1.5]))
WALLTIME = mostly(st.sampled_from(["01:00:00", "00:20:00", "90", 90, "2:00", "02:00:00", "45:00"]),
                  st.sampled_from(["0", 0, "soon", None, True, 3.5, "-5", [], "3-00:00:00"]))
EXTRA = mostly(st.just({}), st.just({"colour": "red"}))
TEXT_LISTS = mostly(st.lists(st.text(max_size=4), max_size=3),
                    st.one_of(st.lists(st.integers(), min_size=1, max_size=2), st.sampled_from(["x", None, ("a",)])))


def _section(fields: dict[str, st.SearchStrategy], required: tuple[str, ...] = ()) -> st.SearchStrategy:
    given = st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                  optional={k: v for k, v in fields.items() if k not in required})
    return mostly(st.tuples(given, EXTRA).map(lambda t: {**t[0], **t[1]}), st.sampled_from([None, "x", [], 3]))


NODE = _section({"cores": mostly(st.integers(8, 128), st.one_of(ODD, st.just("auto"))),
                 "memory": mostly(BIG_MEMORY, st.just("auto")),
                 "gpus": mostly(st.integers(0, 8), st.one_of(ODD_INT, ODD)), "gpu_type": TEXTS,
                 "gpu_vendor": mostly(st.sampled_from(["nvidia", "amd"]), st.sampled_from(["x", 1]))},
                required=("cores", "memory"))
WORKERS = _section({"per": mostly(st.sampled_from(["node", "process", "node", "process", "gpu"]),
                                  st.sampled_from(["socket", None])),
                    "processes": INTS, "threads": mostly(st.one_of(INTS, st.none()), st.just(0)),
                    "reserve_memory": SMALL_MEMORY})
LIMITS = _section({"max_nodes": mostly(st.one_of(INTS, st.none()), st.just(0)),
                   "max_walltime": mostly(st.sampled_from(["2-00:00:00", None, "1-00", "48:00:00", "01:00:00",
                                                           "00:30:00"]),
                                          st.sampled_from(["00:10:00", "soon", 0, True, "1"])),
                   "max_gpus_per_node": mostly(st.sampled_from([None, 0]), st.integers(1, 9))})
MPI = _section({"launch": mostly(st.sampled_from(["auto", "srun", "mpiexec"]), st.just("ssh")),
                "srun_args": TEXT_LISTS, "mpiexec": mostly(st.text(max_size=6), st.none()),
                "flavor": mostly(st.sampled_from(["openmpi", "mpich"]), st.just("intel")), "mpiexec_args": TEXT_LISTS})
SITES = st.tuples(st.fixed_dictionaries(
    {"name": mostly(st.sampled_from(["t", "a.b-c_1", "X9"]), st.sampled_from(["-x", "bad name", "é", 3, "a\n"])),
     "scheduler": mostly(st.sampled_from(["slurm", "pbs", "local"]), st.sampled_from(["lsf", None])), "node": NODE},
    optional={
        "description": mostly(st.text(max_size=6), st.sampled_from([None, 3])),
        "launcher": mostly(st.just("mpi"), st.sampled_from(["jobqueue", "ssh"])),
        "queue": TEXTS, "account": TEXTS, "qos": TEXTS, "walltime": WALLTIME, "workers": WORKERS, "limits": LIMITS,
        "interface": TEXTS, "local_directory": TEXTS, "run_directory": mostly(st.text(max_size=6), st.none()),
        "setup": TEXT_LISTS, "directives": TEXT_LISTS, "python": TEXTS, "mpi": MPI,
        "env": mostly(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
                      st.sampled_from([None, ["a"], {"a": 1}, {1: "a"}, {"a": None}])),
    },
), st.sampled_from([{}] * 12 + [{"colour": "red"}, {"jobqueue": {}}, {"pools": {}}, {"path": "/elsewhere"}])).map(
    lambda t: {**t[0], **t[1]})


@settings(max_examples=1500, deadline=None)
@given(SITES)
def test_the_fast_path_vouches_only_for_what_pydantic_accepts_identically(data: dict[str, Any]) -> None:
    try:
        view = siteview.view(data, Path("/x/t.yaml"))
    except siteview._Unsure:
        return
    site = Site.model_validate({**data, "path": Path("/x/t.yaml")})  # must not raise
    _same(view, site)


BASE = {"name": "t", "scheduler": "slurm", "node": {"cores": 32, "memory": "256GiB", "gpus": 4},
        "workers": {"per": "process", "processes": 2}, "limits": {}, "mpi": {}}
ODD_VALUES = [0, -1, 1, 2, True, False, 4.0, 2.5, "4", " 4", None, "auto", "64GiB", "0B", "01:00:00", "0", "x",
              "mpich", "gpu", "amd", [], {}, ["a"], ("a",), [1], {"a": "b"}, {"a": 1}]
FIELDS = [(section, name) for section in ("node", "workers", "limits", "mpi")
          for name, _, _ in siteview.SECTIONS[section]] + [(None, name) for name, _, check in siteview.SITE if check]


@pytest.mark.parametrize("section, name", FIELDS)
def test_each_field_alone_takes_odd_values_as_pydantic_does(section: str | None, name: str) -> None:
    for value in ODD_VALUES:
        data = {**BASE, **({section: {**BASE[section], name: value}} if section else {name: value})}
        try:
            view = siteview.view(data)
        except siteview._Unsure:
            continue
        _same(view, Site.model_validate(data))


def test_the_generated_files_reach_both_outcomes() -> None:
    """The property above means little unless the fast path accepts a fair share of generated files."""
    accepted = rejected = 0

    @settings(max_examples=400, deadline=None, database=None)
    @given(SITES)
    def count(data: dict[str, Any]) -> None:
        nonlocal accepted, rejected
        try:
            siteview.view(data)
            accepted += 1
        except siteview._Unsure:
            rejected += 1

    count()
    assert accepted >= 100 and rejected >= 40, (accepted, rejected)
