"""Site files: validation messages, the search path, and every shipped site."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_garage.core.errors import SiteError
from hpc_garage.sites import find_sites, load_site
from hpc_garage.sites.files import packaged_dir

GOOD = """\
scheduler: slurm
queue: gpu
walltime: 01:30:00
node: {cores: 32, memory: 256GiB, gpus: 4}
workers: {per: gpu, reserve_memory: 16GiB}
"""


def write(site_dir: Path, name: str, text: str) -> Path:
    path = site_dir / f"{name}.yaml"
    path.write_text(text)
    return path


def test_every_shipped_site_loads() -> None:
    names = {p.stem for p in packaged_dir("site-configs").glob("*.yaml")}
    assert {"local", "slurm-cpu", "slurm-gpu", "pbs-cpu", "pbs-gpu", "lab-gpu", "lab-pbs"} <= names
    for name in names:
        assert load_site(name).name == name


def test_unquoted_clock_walltime_is_not_base_60(site_dir: Path) -> None:
    write(site_dir, "mine", GOOD)
    assert load_site("mine").walltime == 5400


def test_sites_path_wins_over_packaged(site_dir: Path) -> None:
    write(site_dir, "slurm-gpu", GOOD.replace("queue: gpu", "queue: a100"))
    assert load_site("slurm-gpu").queue == "a100"
    assert find_sites()["slurm-gpu"].parent == site_dir


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD.replace("gpus: 4", "gpu: 4"), ["node.gpu", "did you mean 'gpus'"]),
        (GOOD.replace("scheduler: slurm", "scheduler: slrum"), ["scheduler", "'slrum'", "slurm", "pbs", "local"]),
        (GOOD.replace("cores: 32, ", ""), ["node.cores", "missing", "add it"]),
        (GOOD.replace("memory: 256GiB", "memory: 256"), ["node.memory", "'256'", "256GiB"]),
        (GOOD.replace("gpus: 4", "gpus: -1"), ["node.gpus", "-1", "use a number >= 0"]),
        (GOOD.replace("walltime: 01:30:00", "walltime: soon"), ["walltime", "'soon'", "01:30:00"]),
        (GOOD + "colour: red\n", ["unknown key 'colour'"]),
        (GOOD.replace("per: gpu", "per: gpu, threads: 0"), ["workers.threads", "0", "> 0"]),
        (GOOD.replace("cores: 32", "cores: many"), ["node.cores", "'many'", "whole number"]),
        (GOOD.replace("gpus: 4", "gpus: 0"), ["node.gpus is 0", "per: node"]),
        ("scheduler: [slurm\n", ["not valid YAML", "line"]),
        ("- a list\n", ["expected a mapping"]),
    ],
)
def test_bad_site_is_one_line_naming_file_key_value_and_fix(site_dir: Path, text: str, expected: list[str]) -> None:
    path = write(site_dir, "bad", text)
    with pytest.raises(SiteError) as info:
        load_site("bad")
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))
    for fragment in expected:
        assert fragment in message


def test_unknown_site_suggests_the_close_one() -> None:
    with pytest.raises(SiteError, match="did you mean 'slurm-gpu'"):
        load_site("slurm-gp")


def test_site_by_path(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(GOOD)
    assert load_site(str(path)).name == "x"
    with pytest.raises(SiteError, match="does not exist"):
        load_site(str(tmp_path / "nope.yaml"))


# ---- the contract (issue 14): any site file is a Site or one SiteError line, never another exception

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEYS = ["name", "scheduler", "launcher", "queue", "account", "qos", "walltime", "node", "workers", "limits",
        "interface", "local_directory", "run_directory", "setup", "directives", "env", "python", "mpi",
        "jobqueue", "pools", "nodes", "walltim", "cores", "memory", "gpus", "per", "processes", "threads",
        "gpu_vendor", "launch", "jobs", "max_nodes", "reserve_memory", ""]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**20), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(["auto", "slurm", "pbs", "local", "gpu", "64GiB", "1:99:00",
                                                          "90.0", "1e400", "srun", "jobqueue", "-x", "A=B"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=8),
       st.sampled_from([{}, {"scheduler": "slurm", "node": {"cores": 8, "memory": "64GiB"}}]))
def test_any_site_data_is_a_site_or_one_line(data: dict, base: dict) -> None:
    from hpc_garage.core.errors import SiteError
    from hpc_garage.core.site import Site, parse_site_dict

    try:
        site = parse_site_dict({"name": "p", **base, **data})
    except SiteError as exc:
        assert "\n" not in str(exc) and str(exc)
    else:
        assert isinstance(site, Site)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_any_site_file_bytes_are_a_site_or_one_line(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    from hpc_garage.core.errors import SiteError
    from hpc_garage.sites import parse_site_file

    path = tmp_path_factory.mktemp("s") / "x.yaml"
    path.write_bytes(raw)
    try:
        parse_site_file(path)
    except SiteError as exc:
        assert "\n" not in str(exc)


@pytest.mark.parametrize(("text", "found"), [
    ("scheduler: slurm\n", ("~/.hpc-garage/runs", None)),
    ("node: {cores: many}\nrun_directory: /scratch/runs\nresults_directory: /project/sweeps\n",
     ("/scratch/runs", "/project/sweeps")),
    ("run_directory: null\n", None), ("run_directory: ''\n", None), ("run_directory: 3\n", None),
    ("results_directory: [a]\n", None), ("- not a mapping\n", None)])
def test_a_site_files_directories_are_read_as_written(text: str, found: tuple | None, tmp_path: Path) -> None:
    """Where status and resume look for a site's jobs and sweeps: the two keys as written, the rest unchecked;
    a value that is no path is one SiteError naming the file and the key (finding then skips that site)."""
    from hpc_garage.sites.files import directories

    path = tmp_path / "mine.yaml"
    path.write_text(text)
    if found is not None:
        assert directories(path) == found
        return
    with pytest.raises(SiteError) as refused:
        directories(path)
    assert str(refused.value).startswith(f"{path}: ")
