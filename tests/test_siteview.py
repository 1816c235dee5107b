"""The pydantic-free site loader of `show`: it must accept exactly what the pydantic models accept, with the
same values, and hand everything else (errors included) to pydantic."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, create_model

from hpc_garage.core import site_values
from hpc_garage.core.errors import SiteError
from hpc_garage.core.container import ContainerSettings
from hpc_garage.core.site import JobqueueSettings, Limits, MpiSettings, NodeShape, Site, WorkerLayout
from hpc_garage.sites import fields, fields_gen, load_site
from hpc_garage.sites import view as siteview
from hpc_garage.sites.files import packaged_dir
from hpc_garage.sites.view import SiteView


def _defaults(model: type[BaseModel]) -> list[tuple[str, Any]]:
    out = []
    for name, f in model.model_fields.items():
        if f.exclude:
            continue  # not a YAML key (path)
        if f.is_required():
            out.append((name, siteview.REQUIRED))
        else:
            default = f.get_default(call_default_factory=True)
            out.append((name, default.model_dump(mode="json") if isinstance(default, BaseModel) else default))
    return out


def test_fields_py_is_what_the_generator_writes_now() -> None:
    """fields.py is generated from the models: a field added, changed or removed there must reach the view."""
    written, now = Path(fields.__file__).read_text(), fields_gen.render()
    if written != now:
        diff = "".join(difflib.unified_diff(written.splitlines(True), now.splitlines(True), "fields.py", "now", n=1))
        pytest.fail(f"hpc_garage/sites/fields.py is out of date with hpc_garage/core/site.py; regenerate it with "
                    f"`{fields_gen.COMMAND}` (then run these tests again)\n{diff[:3000]}")


MODELS = {"site": Site, "node": NodeShape, "workers": WorkerLayout, "limits": Limits, "mpi": MpiSettings,
          "jobqueue": JobqueueSettings, "container": ContainerSettings}


@pytest.mark.parametrize("key", list(MODELS))
def test_the_views_tables_have_the_models_fields_order_and_defaults(key: str) -> None:
    table = siteview.SITE if key == "site" else siteview.SECTIONS[key]
    assert [(name, default) for name, default, _ in table] == _defaults(MODELS[key])
    assert set(siteview.SECTIONS) | {"site"} == set(MODELS)  # a new nested model: add it to MODELS


def test_the_view_checks_every_section_but_jobqueue() -> None:
    """A validator added to a model the view checks must be mirrored in view() (and named in MIRRORED); until it
    is, the view hands every site that gives that section (for Site: every site) to pydantic."""
    unmirrored = {key: section["hooks"] for key, section in fields.SECTIONS.items() if key not in siteview.TRUSTED}
    assert set(unmirrored) == {"jobqueue"}, f"validators the view does not mirror (see view.MIRRORED): {unmirrored}"


class _Toy(BaseModel):
    count: int | None = Field(None, ge=2, lt=10)
    size: Annotated[int, BeforeValidator(site_values.memory), Field(gt=0)] = 1024
    kind: Literal["a", "b"] = "a"
    tag: str = Field("x", pattern=r"^x+$")
    things: dict[str, int] = Field(default_factory=dict)
    flag: bool | None = None


def test_the_generator_describes_a_model_as_the_view_reads_it() -> None:
    assert fields_gen.describe(_Toy, "toy")["toy"] == {"model": "_Toy", "hooks": [], "excluded": [], "fields": [
        {"name": "count", "kind": "int", "optional": True, "default": None, "ge": 2, "lt": 10},
        {"name": "size", "kind": "int", "default": 1024, "convert": "memory", "gt": 0},
        {"name": "kind", "kind": "choice", "default": "a", "choices": ["a", "b"]},
        {"name": "tag", "kind": "str", "default": "x", "pattern": "^x+$"},
        {"name": "things", "kind": "any", "default": {}},  # not a plain kind: pydantic's when given
        {"name": "flag", "kind": "bool", "optional": True, "default": None},
    ]}


@pytest.mark.parametrize("annotation, default, says", [
    (Annotated[int, Field(multiple_of=2)], 2, "Bad.x: the fast path cannot check MultipleOf"),
    (Annotated[int, AfterValidator(abs)], 2, "Bad.x: the fast path cannot check AfterValidator"),
    (Annotated[int, BeforeValidator(abs)], 2, "Bad.x: the fast path cannot check BeforeValidator"),
    (Annotated[str, Field(max_length=3)], "a", "Bad.x: the fast path cannot check MaxLen"),
    (Annotated[int, Field(validation_alias="y")], 2, "Bad.x: an alias"),
    (tuple[str, ...], ("a",), "Bad.x: default ('a',) is not plain JSON"),
])
def test_the_generator_refuses_what_the_view_could_not_check_as_pydantic_does(annotation: Any, default: Any,
                                                                               says: str) -> None:
    bad = create_model("Bad", x=(annotation, default))
    with pytest.raises(fields_gen.GeneratorError, match=re.escape(says)):
        fields_gen.describe(bad)


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
