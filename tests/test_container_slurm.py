"""A sweep inside a container image, for real: Charliecloud's `ch-run` with the image scripts/container-image
builds (Debian's /usr, this host's Python, the project's wheel, and `garage_image_probe`, which the host's Python
lacks). The flow and every trial import that package and report, from inside, the image's marker and
interpreter; on the local SLURM (2 nodes x 4 fake GPUs) each trial has its own GPU, and status, report and
--resume work as without a container. Podman cannot run here (crun: setrlimit RLIMIT_NOFILE: Operation not
permitted); Apptainer, Singularity and Pyxis are not installable: their lines are tested as text
(tests/test_container.py)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
from tests.containers import SWEEP, build_image, check_inside, hpcg, site_file
from tests.slurm_jobs import job_logs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_image(tmp_path_factory.mktemp("image") / "img")


def test_doctor_runs_the_images_python_and_finds_this_version(tmp_path: Path, image: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # ch-run binds the working directory only onto a path the image has (/tmp: shared)
    from hpc_garage._version import __version__
    from hpc_garage.doctor.container import container_check
    from hpc_garage.sites import parse_site_file

    site = parse_site_file(site_file(tmp_path, image))
    check = container_check(site, {**os.environ, "USER": os.environ.get("USER", "root")})
    assert check is not None and not check.failed, check.line() if check else None
    assert f"charliecloud image {image}: hpc-garage {__version__} inside, as here" in check.line()


def test_login_node_run_inside_the_image(tmp_path: Path, image: Path) -> None:
    out, marks = tmp_path / "out.json", tmp_path / "marks"
    done = hpcg(["run", "--site", str(site_file(tmp_path, image)), "--", "python3", SWEEP.name, "4", str(out),
                 str(marks)], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    check_inside(out, 4)


@pytest.mark.slurm
def test_two_nodes_four_gpus_each_trial_inside_the_image_on_its_own_gpu(tmp_path: Path, image: Path) -> None:
    out, marks, seeds = tmp_path / "out.json", tmp_path / "marks", 16
    site = site_file(tmp_path, image, scheduler="slurm", queue="gpu", node="{cores: 8, memory: 15GiB, gpus: 4}",
                     workers="{per: gpu, reserve_memory: 512MiB}", interface="lo")
    done = hpcg(["submit", "--site", str(site), "--nodes", "2", "--wait", SWEEP.name, str(seeds), str(out),
                 str(marks)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")
    records = check_inside(out, seeds)
    spans = collections.defaultdict(list)
    for r in records:
        device = r["cuda_visible_devices"]
        assert device and "," not in device, r  # one GPU each
        spans[(r["worker"].rsplit("-gpu", 1)[0], device)].append((r["start"], r["end"]))
    assert {node.rsplit("-", 1)[-1] for node, _ in spans} == {"n0", "n1"}
    for one in spans.values():  # no GPU ran two trials at once
        one.sort()
        assert all(a[1] <= b[0] for a, b in zip(one, one[1:])), one
    job = next(line.split()[2] for line in done.stdout.splitlines() if line.startswith("submitted job"))
    status = hpcg(["status", job, "--site", str(site)], tmp_path)
    assert status.returncode == 0 and f"{seeds} done" in status.stdout, status.stdout + status.stderr
    report = hpcg(["report", job, "--site", str(site)], tmp_path)
    assert report.returncode == 0 and f"{seeds} trials ({seeds} done" in report.stdout, report.stdout + report.stderr
    # resumed: every trial is read back from the sweep's results, none runs again, and the result is the same
    out.unlink()
    again = hpcg(["submit", "--site", str(site), "--nodes", "1", "--resume", "--wait", SWEEP.name, str(seeds), str(out),
                  str(marks)], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr + job_logs(tmp_path / "runs")
    check_inside(out, seeds)
    assert sorted(int(x) for x in marks.read_text().split()) == list(range(seeds))


LAUNCHES = {
    "dask-mpi": {"mpi": '{launch: dask-mpi, srun_args: ["--mpi=pmix"]}', "env": '{OMPI_MCA_btl: "tcp,self"}'},
    "jobqueue": {"launcher": "jobqueue", "jobqueue": "{gpus_per_job: 2, jobs: 2}", "walltime": '"00:10:00"'},
}


@pytest.mark.slurm
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_dask_mpi_ranks_and_jobqueue_worker_jobs_run_inside_the_image(tmp_path: Path, image: Path, launch: str) -> None:
    out, marks, seeds = tmp_path / "out.json", tmp_path / "marks", 8
    site = site_file(tmp_path, image, scheduler="slurm", queue="gpu", node="{cores: 8, memory: 15GiB, gpus: 4}",
                     workers="{per: gpu, reserve_memory: 512MiB}", interface="lo", **LAUNCHES[launch])
    nodes = ["--nodes", "2"] if launch == "dask-mpi" else []
    done = hpcg(["submit", "--site", str(site), *nodes, "--wait", SWEEP.name, str(seeds), str(out), str(marks)],
                tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")
    records = check_inside(out, seeds)
    assert all(r["cuda_visible_devices"] and "," not in r["cuda_visible_devices"] for r in records), records
    assert len({r["worker"] for r in records}) > 1
