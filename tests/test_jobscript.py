"""Job-script rendering: directives per batch system from the site and the layout, and a body that stays inert.

The quoting tests run the rendered script with bash for real, with the exec line's program replaced by
`printf '%s\\0'`, and compare what arrives byte for byte.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_garage.core.errors import UserError
from hpc_garage.core.request import Request
from hpc_garage.schedulers.jobscript import JobSpec, job_spec, render
from hpc_garage.core.site import Site
from hpc_garage.sites import load_site
from tests.conftest import ROOT, outside_job_env

SITES = ROOT / "site-configs"


def site(name: str) -> Site:
    return load_site(SITES / f"{name}.yaml")


def spec_for(site_: Site, **request: Any) -> JobSpec:
    command = {"output": "/runs/%j.out", "workdir": "/home/me/sweeps", "python": "/venv/bin/python",
               "script": "/home/me/sweeps/flow.py"}
    command |= {k: request.pop(k) for k in ("output", "workdir", "python", "script", "args", "error") if k in request}
    return job_spec(site_, Request(**request), **command)[0]


def directives(text: str, prefix: str) -> list[str]:
    return [line.removeprefix(prefix + " ") for line in text.splitlines() if line.startswith(prefix + " ")]


def body(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]


# ---------------------------------------------------------------------------------------------- SLURM


def test_slurm_gpu_one_node_one_task_per_gpu() -> None:
    text = render(spec_for(site("lab-gpu")))
    assert text.startswith("#!/bin/bash\n")
    assert directives(text, "#SBATCH") == [
        "--job-name=flow",
        "--nodes=1",
        "--ntasks-per-node=4",  # workers.per: gpu, 4 GPUs: one task per worker, no extra scheduler task
        "--cpus-per-task=2",  # 8 cores / 4 workers: every core claimed
        "--mem=15360M",
        "--time=00:20:00",
        "--output=/runs/%j.out",
        "--partition=gpu",
        "--gres=gpu:4",
    ]


def test_slurm_cpu_two_nodes() -> None:
    text = render(spec_for(site("lab-cpu"), nodes=2, walltime=3600))
    d = directives(text, "#SBATCH")
    assert "--nodes=2" in d and "--ntasks-per-node=2" in d and "--cpus-per-task=4" in d and "--time=01:00:00" in d
    assert not any(x.startswith("--gres") for x in d)


def test_slurm_gpu_type_account_qos_and_site_directives() -> None:
    custom = site("slurm-gpu").model_copy(update={"account": "proj", "directives": ["--constraint=ib", "--exclusive"]})
    text = render(spec_for(custom, gpus_per_node=2, qos="high"))
    d = directives(text, "#SBATCH")
    assert "--gres=gpu:a100:2" in d and "--ntasks-per-node=2" in d and "--cpus-per-task=8" in d and "--mem=131072M" in d  # half the GPUs: half the node
    assert "--account=proj" in d and "--qos=high" in d
    assert d[-2:] == ["--constraint=ib", "--exclusive"]  # the site's lines come last, verbatim


def test_slurm_setup_lines_are_verbatim_before_the_exec_line() -> None:
    text = render(spec_for(site("slurm-gpu")))
    lines = body(text)
    assert lines[0] == "cd /home/me/sweeps || exit 1"
    assert lines[1:3] == ["module load cuda", "source ~/.venvs/sweeps/bin/activate"]
    assert lines[3] == "PY=/venv/bin/python"
    assert lines[4] == (
        f'exec "$PY" -m hpc_garage run --site {SITES / "slurm-gpu.yaml"} -- "$PY" /home/me/sweeps/flow.py'
    )


def test_cores_per_worker_is_sbatch_minus_c() -> None:
    spec = spec_for(site("lab-cpu"), cores_per_worker=3)  # 2 workers per node
    assert (spec.tasks_per_node, spec.cpus_per_task) == (2, 3)
    with pytest.raises(UserError, match=r"-c 5: .* 2 × 5 = 10 cores, but a node has 8; ask for at most -c 4"):
        spec_for(site("lab-cpu"), cores_per_worker=5)
    with pytest.raises(UserError, match="not both"):
        spec_for(site("lab-cpu"), cores_per_worker=2, cores_per_node=4)


def test_request_outside_the_site_limits_is_refused() -> None:
    with pytest.raises(UserError, match="at most 2 nodes"):
        spec_for(site("lab-cpu"), nodes=3)
    with pytest.raises(UserError, match="--gpus-per-node 5"):
        spec_for(site("lab-gpu"), gpus_per_node=5)


def test_gpu_type_must_match_the_site() -> None:
    with pytest.raises(UserError, match="'v100'.*'a100'"):
        spec_for(site("slurm-gpu"), gpu_type="v100")


# ------------------------------------------------------------------------------------------------ PBS


def test_pbs_gpu_select_chunk_is_mpiexec_ready() -> None:
    text = render(spec_for(site("pbs-gpu"), nodes=2))
    assert directives(text, "#PBS") == [
        "-N flow",
        # mpiprocs = workers per node, so PBS_NODEFILE lists each node once per rank; mem comes last
        "-l select=2:ncpus=64:mpiprocs=4:ngpus=4:mem=512gb",
        "-l walltime=02:00:00",
        "-j oe",
        "-o /runs/%j.out",
        "-q gpu",
        "-l place=scatter",
    ]
    assert "module load cuda" in body(text)


def test_pbs_cpu_one_node_has_no_gpus_and_no_place() -> None:
    text = render(spec_for(site("pbs-cpu"), memory=100 * 2**30 + 2**20, account="proj"))
    d = directives(text, "#PBS")
    assert "-l select=1:ncpus=36:mpiprocs=1:mem=102401mb" in d
    assert "-A proj" in d and not any("place" in x for x in d)


def test_pbs_has_no_qos() -> None:
    with pytest.raises(UserError, match="PBS has no QOS"):
        spec_for(site("pbs-cpu"), qos="high")


def test_pbs_log_path_must_be_plain() -> None:
    with pytest.raises(UserError, match="log path"):
        spec_for(site("pbs-cpu"), output="/my runs/x.out")


# -------------------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        ({"job_name": "x; rm -rf ~"}, "job name 'x; rm -rf ~'"),
        ({"job_name": "a\nb"}, "job name"),
        ({"job_name": ""}, "job name"),
        ({"account": "a b"}, "--account 'a b'"),
        ({"account": "$(id)"}, "--account"),
        ({"qos": "x\n#SBATCH --mem=1"}, "--qos"),
        ({"queue": "cpu;reboot"}, "partition"),
        ({"output": "/tmp/x\n#SBATCH --wrap=id"}, "--output"),
        ({"error": '/tmp/"x'}, "--error"),
        ({"extra_directives": ["--comment=a\n#SBATCH --nodes=64"]}, "newline"),
        ({"args": ["a\0b"]}, "NUL"),
    ],
)
def test_hostile_values_are_refused_in_one_line(request_: dict[str, Any], fragment: str) -> None:
    with pytest.raises(UserError, match=None) as info:
        spec_for(site("lab-cpu"), **request_)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_site_directive_with_a_newline_is_refused() -> None:
    bad = site("lab-cpu").model_copy(update={"directives": ["--comment=x\nrm -rf ~"]})
    with pytest.raises(UserError, match="newline"):
        spec_for(bad)


def test_output_path_with_spaces_is_quoted_in_slurm_directives() -> None:
    text = render(spec_for(site("lab-cpu"), output="/my runs/%j.out"))
    assert '#SBATCH --output="/my runs/%j.out"' in text


def test_default_job_name_comes_from_the_script_made_plain() -> None:
    assert spec_for(site("lab-cpu"), script="/x/my flow $(id).py").job_name == "my_flow___id_"


def run_rendered(text: str, cwd: Path) -> list[str]:
    """Run the job script with bash, the exec line printing its argv NUL-separated instead."""
    probe = text.replace('exec "$PY"', "exec printf '%s\\0'")
    assert probe != text
    done = subprocess.run(["bash", "-c", probe], capture_output=True, cwd=cwd, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().split("\0")[:-1]


HOSTILE = [
    "plain",
    "two words",
    "it's",
    '"double"',
    "$(touch {canary})",
    "`touch {canary}`",
    "; touch {canary}",
    "a\nb\n",
    "new\nline; touch {canary}",
    "$HOME ${HOME} $$ !! \\ * ? [a] ~ {a,b}",
    "-- --site other",
    "",
    " ",
    "\t",
    "é ü ✓",
]


def test_rendered_script_passes_everything_through_and_runs_nothing(tmp_path: Path) -> None:
    weird = tmp_path / "dir with spaces $(touch PWNED) 'q' \"d\" `touch PWNED`"
    weird.mkdir()
    script = weird / "flow; touch PWNED $(touch PWNED).py"
    script.write_text("")
    args = [a.replace("{canary}", "PWNED") for a in HOSTILE]
    spec = spec_for(
        site("lab-cpu"), script=str(script), args=args, workdir=str(weird), python=str(weird / "py $(touch PWNED)"),
        job_name="x.y-z_1+2", output=str(tmp_path / "%j.out"),
    )
    argv = run_rendered(render(spec), cwd=tmp_path)
    assert argv == spec.command[1:]  # -m hpc_garage run --site S -- PY SCRIPT ARGS..., byte for byte
    assert argv[-len(args) - 2:-len(args)] == [str(weird / "py $(touch PWNED)"), str(script)]
    assert argv[-len(args):] == args
    assert not list(tmp_path.rglob("PWNED"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",))), max_size=5))
def test_any_arguments_arrive_unchanged(tmp_path_factory: pytest.TempPathFactory, args: list[str]) -> None:
    tmp = tmp_path_factory.mktemp("args")
    spec = spec_for(site("lab-cpu"), args=args, workdir=str(tmp), output=str(tmp / "%j.out"))
    assert run_rendered(render(spec), cwd=tmp) == spec.command[1:]


def test_rendering_is_pure() -> None:
    spec = spec_for(site("lab-gpu"), args=["x"])
    assert render(spec) == render(spec)


# ------------------------------------------------------------------------------------------------- CLI


def hpcg(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    import os
    import sys

    env = outside_job_env()
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "hpc_garage", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=60)


def test_show_script_is_what_submit_dry_run_prints_and_imports_nothing_heavy(tmp_path: Path) -> None:
    (tmp_path / "flow.py").write_text("")
    shown = hpcg("show", "--site", "lab-gpu", "-N", "2", "--script", "flow.py", "--lr", "0.1", cwd=tmp_path)
    dry = hpcg("submit", "--site", "lab-gpu", "-N", "2", "--dry-run", "flow.py", "--lr", "0.1", cwd=tmp_path)
    sbatch = hpcg("sbatch", "--site", "lab-gpu", "-N2", "--dry-run", "flow.py", "--lr", "0.1", cwd=tmp_path)
    assert shown.returncode == dry.returncode == sbatch.returncode == 0, (shown.stderr, dry.stderr, sbatch.stderr)
    assert shown.stdout == dry.stdout == sbatch.stdout
    assert "#SBATCH --nodes=2" in shown.stdout and shown.stdout.rstrip().endswith(f"{tmp_path}/flow.py --lr 0.1")
    for done in (shown, dry, sbatch):
        imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
        assert not imported & {"prefect", "distributed", "dask_jobqueue"}
    assert list(tmp_path.iterdir()) == [tmp_path / "flow.py"]


def test_show_script_without_a_script_uses_a_placeholder(tmp_path: Path) -> None:
    done = hpcg("show", "--site", "lab-cpu", "--script", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.rstrip().endswith(f"{tmp_path}/SCRIPT.py")
    done = hpcg("show", "--site", "lab-cpu", "flow.py", cwd=tmp_path)
    assert done.returncode == 2 and "only with --script" in done.stderr
