"""Allocation.from_env inside real jobs on the local SLURM: through sbatch, and through qsub as PBS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.slurm_jobs import exit_code, submit, wait_gone

pytestmark = pytest.mark.slurm

READ = f"""{sys.executable} -c '
import json, sys
from hpc_garage.schedulers import allocation_from_env
from hpc_garage.sites import load_site
a = allocation_from_env(load_site(sys.argv[1]))
json.dump(a.to_dict(), open(sys.argv[2], "w"))
'"""


def test_sbatch_job_reads_what_it_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "alloc.json"
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH -p gpu -N 2 --ntasks-per-node=1 -c 3 --gres=gpu:2 --mem=3000 -t 5 -o {tmp_path}/job.out
{READ} lab-gpu {out}
""")
    job = submit(["sbatch", "--parsable"], script)
    assert exit_code(wait_gone(job)) == 0, (tmp_path / "job.out").read_text()
    a = json.loads(out.read_text())
    assert a["source"] == "slurm" and a["job_id"] == job
    assert [n["host"] for n in a["nodes"]] == ["node1", "node2"]
    assert all(n["cores"] == 3 and n["memory"] == 3000 * 2**20 for n in a["nodes"])
    assert all(len(n["gpus"]) == 2 for n in a["nodes"])


def test_qsub_job_reads_a_pbs_allocation(tmp_path: Path) -> None:
    out = tmp_path / "alloc.json"
    script = tmp_path / "job.pbs"
    # A CPU job, read with a PBS CPU site (a GPU site now refuses a job without GPUs: issue 13).
    # Slurm's Torque wrapper sets PBS_JOBID but never PBS_NODEFILE or NCPUS: give the job what PBS would,
    # and drop every SLURM variable, so the PBS reader is the only one that can answer.
    script.write_text(f"""#!/bin/bash
#PBS -l select=1:ncpus=2:mem=2gb
#PBS -l walltime=00:07:00
#PBS -q cpu
export PBS_NODEFILE=$(generate_pbs_nodefile) NCPUS=2
for v in ${{!SLURM_@}}; do [ "$v" = SLURM_CONF ] || unset "$v"; done
{READ} pbs-cpu {out}
""")
    job = submit(["qsub"], script)
    assert exit_code(wait_gone(job)) == 0
    a = json.loads(out.read_text())
    assert a["source"] == "pbs" and a["job_id"] == job
    assert [n["host"] for n in a["nodes"]] == ["node1"] or len(a["nodes"]) == 1
    assert a["nodes"][0]["cores"] == 2
    assert a["walltime"] == 7 * 60  # from qstat -f
