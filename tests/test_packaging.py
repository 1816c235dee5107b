"""The wheel that `pip install .` builds carries the site configs and job-script templates; CI's test shards
name real tests."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_carries_site_configs_and_jobscripts(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("hpc_garage-*.whl")
    from hpc_garage._version import __version__

    assert wheel.name.startswith(f"hpc_garage-{__version__}-")  # hatch reads the version from _version.py
    names = set(zipfile.ZipFile(wheel).namelist())
    for site in ("local", "slurm-cpu", "slurm-gpu", "pbs-cpu", "pbs-gpu", "lab-gpu"):
        assert f"hpc_garage/_data/site-configs/{site}.yaml" in names
    assert {"hpc_garage/_data/jobscripts/slurm.sh", "hpc_garage/_data/jobscripts/pbs.sh"} <= names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "hpc-garage = hpc_garage.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_every_shard_key_names_a_test_module_or_a_quick_benchmark() -> None:
    """A renamed module would silently fall back to shard 1 and unbalance CI (tests/conftest.py: SHARDS)."""
    from tests.conftest import QUICK_BENCH, SHARDS, shard_of
    from tests.test_bench import QUICK

    tests = Path(__file__).resolve().parent
    for key, shard in SHARDS.items():
        module = key.split("::")[0]
        assert (tests / module).is_file(), key
        if key.startswith(QUICK_BENCH):
            assert key.split("[")[1].rstrip("]") in QUICK, key
        assert shard_of(f"tests/{key}") == shard and shard in ("2", "3", "4", "5") + ("1",) * key.startswith(QUICK_BENCH)
    assert shard_of("tests/test_e2e.py::test_x") == "1"  # the default cluster, whose node names tests assert
    from tests.conftest import BESIDE_SHARDS

    assert all((tests / key.split("::")[0]).is_file() and shard in ("1", "2", "3", "4", "5")
               for key, shard in BESIDE_SHARDS.items())
