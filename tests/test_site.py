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
