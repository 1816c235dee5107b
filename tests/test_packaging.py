"""The wheel that `pip install .` builds carries the site configs and job-script templates."""

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
