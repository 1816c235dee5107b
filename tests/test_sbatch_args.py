"""`hpc-garage sbatch`'s option parser, table-driven: what people type → the request, the pass-through, or a refusal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.schedulers.sbatch_options import parse, site_for

GiB = 2**30

CASES: list[tuple[str, dict[str, Any]]] = [
    ("flow.py", {"script": "flow.py", "args": ()}),
    ("-N2 flow.py", {"nodes": 2}),
    ("-N 2 flow.py", {"nodes": 2}),
    ("--nodes=2 flow.py", {"nodes": 2}),
    ("--nodes 2 flow.py", {"nodes": 2}),
    ("-p gpu flow.py", {"partition": "gpu"}),
    ("-pgpu flow.py", {"partition": "gpu"}),
    ("--partition=gpu flow.py", {"partition": "gpu"}),
    ("--gres=gpu:2 flow.py", {"gpus_per_node": 2, "gpu_type": None}),
    ("--gres gpu:a100:4 flow.py", {"gpus_per_node": 4, "gpu_type": "a100"}),
    ("--gres=gpu flow.py", {"gpus_per_node": 1}),
    ("--gres=gpu:a100 flow.py", {"gpus_per_node": 1, "gpu_type": "a100"}),
    ("-G 4 -N 2 flow.py", {"gpus_per_node": 2, "nodes": 2}),
    ("--gpus=a100:4 flow.py", {"gpus_per_node": 4, "gpu_type": "a100"}),
    ("--gpus-per-node=3 flow.py", {"gpus_per_node": 3}),
    ("--gpus-per-node a100:3 flow.py", {"gpus_per_node": 3, "gpu_type": "a100"}),
    ("-t 90 flow.py", {"walltime": 5400}),
    ("-t1-00:00:00 flow.py", {"walltime": 86400}),
    ("--time=01:30:00 flow.py", {"walltime": 5400}),
    ("--mem=64G flow.py", {"memory": 64 * GiB}),
    ("--mem 4000 flow.py", {"memory": 4000 * 2**20}),
    ("--mem=0 flow.py", {"memory": None}),  # sbatch: all of the node's memory = the site's default
    ("-c 4 flow.py", {"cores_per_worker": 4}),
    ("--cpus-per-task=4 flow.py", {"cores_per_worker": 4}),
    ("-A proj -J sweep flow.py", {"account": "proj", "job_name": "sweep"}),
    ("--account=proj --job-name=sweep flow.py", {"account": "proj", "job_name": "sweep"}),
    ("-o out.%j -e err.%j flow.py", {"output": "out.%j", "error": "err.%j"}),
    ("--qos=high flow.py", {"qos": "high"}),
    ("-q high flow.py", {"qos": "high"}),
    ("--site lab-cpu flow.py", {"site": "lab-cpu"}),
    ("--dry-run -W flow.py", {"dry_run": True, "wait": True}),
    ("--wait --parsable flow.py", {"wait": True}),
    # pass-through: written as #SBATCH lines
    ("-C a100 flow.py", {"passthrough": ["-C a100"]}),
    ("--constraint=ib&a100 flow.py", {"passthrough": ["--constraint=ib&a100"]}),
    ("--constraint ib flow.py", {"passthrough": ["--constraint=ib"]}),
    ("--exclusive flow.py", {"passthrough": ["--exclusive"]}),
    ("--exclusive=user flow.py", {"passthrough": ["--exclusive=user"]}),
    ("-HQ flow.py", {"passthrough": ["-H", "-Q"]}),
    ("--comment 'two words' flow.py", {"passthrough": ['--comment="two words"']}),
    ("--mail-type=END -w node1 flow.py", {"passthrough": ["--mail-type=END", "-w node1"]}),
    # the script's own arguments are never ours, even when they look like options
    ("-N 2 flow.py -N 3 --mem=1 -- x", {"nodes": 2, "script": "flow.py", "args": ("-N", "3", "--mem=1", "--", "x")}),
    ("-- -weird-script.py a", {"script": "-weird-script.py", "args": ("a",)}),
]


@pytest.mark.parametrize(("line", "expected"), CASES, ids=[c[0] for c in CASES])
def test_parse(line: str, expected: dict[str, Any]) -> None:
    import shlex

    call = parse(shlex.split(line))
    for key, value in expected.items():
        assert getattr(call, key) == value, key


REFUSED = [
    ("", "no script given"),
    ("-N", "-N needs a value"),
    ("-N 1-3 flow.py", "fixed node count"),
    ("-N two flow.py", "fixed node count"),
    ("-n 4 flow.py", "drop -n/--ntasks"),
    ("--ntasks=4 flow.py", "drop -n/--ntasks"),
    ("--ntasks-per-node=4 flow.py", "workers per node"),
    ("--mem-per-cpu=2G flow.py", "use --mem"),
    ("--array=1-10 flow.py", "job arrays"),
    ("--wrap='python x.py'", "--wrap"),
    ("-D /tmp flow.py", "cd there first"),
    ("--test-only flow.py", "--dry-run"),
    ("-p a,b flow.py", "one partition"),
    ("--gres=gpu:2,shard:1 flow.py", "gpu gres only"),
    ("--gres=nic:1 flow.py", "gpu gres only"),
    ("-G 3 -N 2 flow.py", "not a whole number per node"),
    ("--gres=gpu:2 -G 2 flow.py", "more than once"),
    ("--gpus-per-node=x flow.py", "whole number"),
    ("-c 0x2 flow.py", "whole number"),
    ("--mem=lots flow.py", "--mem lots"),
    ("-t forever flow.py", "-t/--time forever"),
    ("-N 2 --nodes=3 flow.py", "given twice"),
    ("--dry-run=yes flow.py", "takes no value"),
    ("--comment='say \"hi\"' flow.py", "cannot be passed on"),
]


@pytest.mark.parametrize(("line", "fragment"), REFUSED, ids=[r[0] or "<empty>" for r in REFUSED])
def test_refused(line: str, fragment: str) -> None:
    import shlex

    with pytest.raises(UserError) as info:
        parse(shlex.split(line))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("line", "fragment"), [("--gress=gpu:2 x.py", "did you mean --gres?"),
                                                ("--nodess 2 x.py", "did you mean --nodes?"),
                                                ("-X x.py", "not an sbatch option")])
def test_unknown_options_are_refused_not_passed_on(line: str, fragment: str) -> None:
    with pytest.raises(UserError, match=re.escape(fragment)):
        parse(shlex.split(line))


def test_options_become_one_request() -> None:
    """(Was: the loose keywords match job_spec's; the core Request type now carries them.)"""
    from hpc_garage.core.request import Request

    call = parse(["-N", "2", "-p", "gpu", "--mem=4G", "-C", "a100", "-J", "x", "flow.py"])
    assert call.request() == Request(nodes=2, queue="gpu", memory=4 * 2**30, job_name="x",
                                     extra_directives=("-C a100",))


# ------------------------------------------------------------------------------------- choosing the site


def write_site(directory: Path, name: str, scheduler: str, queue: str) -> None:
    (directory / f"{name}.yaml").write_text(
        f"scheduler: {scheduler}\nqueue: {queue}\nnode:\n  cores: 4\n  memory: 8GiB\n"
    )


@pytest.fixture
def only_my_sites(site_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Just the sites in site_dir: no ./site-configs, no packaged ones."""
    import hpc_garage.sites as site_module

    monkeypatch.setattr(site_module, "search_path", lambda env=None: [site_dir])
    return site_dir


def test_partition_picks_the_one_slurm_site(only_my_sites: Path) -> None:
    write_site(only_my_sites, "a", "slurm", "cpu")
    write_site(only_my_sites, "b", "slurm", "gpu")
    write_site(only_my_sites, "c", "pbs", "cpu")  # a PBS queue of the same name is not a candidate
    assert site_for(parse(["-p", "cpu", "x.py"])) == "a"
    assert site_for(parse(["-p", "gpu", "x.py"])) == "b"


def test_ambiguous_partition_lists_candidates(only_my_sites: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a login node without SLURM's commands: sinfo cannot tell the two apart (with them but no controller
    # answering, sinfo gives up after 9 s here, the same way)
    monkeypatch.setenv("PATH", str(only_my_sites))
    write_site(only_my_sites, "a", "slurm", "cpu")
    write_site(only_my_sites, "b", "slurm", "cpu")
    with pytest.raises(UserError, match=r"-p cpu: 2 SLURM sites use it \(a, b\); pick one with --site NAME"):
        site_for(parse(["-p", "cpu", "x.py"]))


def test_unknown_partition_lists_what_exists(only_my_sites: Path) -> None:
    write_site(only_my_sites, "a", "slurm", "cpu")
    with pytest.raises(UserError, match=r"-p nosuch: no SLURM site uses this partition \(sites by partition: cpu: a\)"):
        site_for(parse(["-p", "nosuch", "x.py"]))


def test_site_flag_must_be_slurm_and_agree_with_the_partition(only_my_sites: Path) -> None:
    """(Was: --site wins over a contradicting -p. Issue 14: a contradiction is refused, not resolved silently.)"""
    write_site(only_my_sites, "a", "slurm", "cpu")
    write_site(only_my_sites, "p", "pbs", "cpu")
    assert site_for(parse(["--site", "a", "-p", "cpu", "x.py"])) == "a"
    with pytest.raises(UserError, match="-p other: site a describes partition cpu's nodes"):
        site_for(parse(["--site", "a", "-p", "other", "x.py"]))
    with pytest.raises(UserError, match="hpc-garage submit --site p"):
        site_for(parse(["--site", "p", "x.py"]))


def test_no_partition_means_the_clusters_default(only_my_sites: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_garage.schedulers.slurm import Slurm

    write_site(only_my_sites, "a", "slurm", "cpu")
    monkeypatch.setattr(Slurm, "run", lambda self, argv, **kw: "cpu*\ngpu\n")
    assert site_for(parse(["x.py"])) == "a"
