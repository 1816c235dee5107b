"""The CLI as a user meets it: real processes, exit codes, one-line errors, and a light start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DATA, read_env_dump, outside_job_env

HEAVY = ("prefect", "distributed", "dask_jobqueue")


def hpcg(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_garage", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def clean_env(**extra: str) -> dict[str, str]:
    env = outside_job_env()
    return env | extra


def test_show_json_is_one_object_with_the_contracted_keys(tmp_path: Path) -> None:
    done = hpcg("show", "--site", "slurm-gpu", "--nodes", "2", "--json", env=clean_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert set(data) >= {"site", "allocation", "workers"}
    assert len(data["workers"]) == 8
    w = data["workers"][0]
    assert set(w) >= {"name", "node", "host", "nthreads", "memory_limit", "resources", "env"}
    assert isinstance(w["memory_limit"], int) and w["resources"]["GPU"] == 1


def test_show_reads_the_jobs_own_allocation_inside_a_job(tmp_path: Path) -> None:
    env = clean_env(**read_env_dump(DATA / "env" / "slurm-1node-2gpu.env"))
    done = hpcg("show", "--site", "lab-gpu", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["allocation"]["source"] == "slurm" and data["allocation"]["job_id"] == "6"
    assert [w["env"]["CUDA_VISIBLE_DEVICES"] for w in data["workers"]] == ["0", "1"]


def test_show_text_for_pbs(tmp_path: Path) -> None:
    done = hpcg("show", "--site", "pbs-gpu", "--nodes", "3", env=clean_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "nodes 0-2:" in done.stdout and "4 workers × {GPU=1, CPU=16" in done.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["show", "--site", "nosuch"], "unknown site 'nosuch'"),
        (["show", "--site", "slurm-gpu", "--gpus-per-node", "5"], "--gpus-per-node 5"),
        (["show", "--site", "slurm-gpu", "--time", "3-00:00:00"], "limits.max_walltime"),
        (["show", "--site", "slurm-gpu", "--mem", "lots"], "lots"),
    ],
)
def test_user_errors_are_one_line_exit_2_no_traceback(args: list[str], fragment: str, tmp_path: Path) -> None:
    done = hpcg(*args, env=clean_env(), cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and fragment in done.stderr
    assert len([ln for ln in done.stderr.splitlines() if "error" in ln.lower()]) == 1


def test_bad_site_file_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "site-configs").mkdir()
    (tmp_path / "site-configs" / "mine.yaml").write_text("scheduler: slurm\nnode: {cores: 4, memroy: 8GiB}\n")
    done = hpcg("show", "--site", "mine", env=clean_env(), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
    assert "mine.yaml" in done.stderr and "node.memroy" in done.stderr and "did you mean 'memory'" in done.stderr


def test_sites_lists_where_each_was_found(tmp_path: Path) -> None:
    done = hpcg("sites", "--json", env=clean_env(), cwd=tmp_path)
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert rows["slurm-gpu"]["node"]["gpus"] == 4 and rows["slurm-gpu"]["path"].endswith("slurm-gpu.yaml")


def test_version() -> None:
    from hpc_garage import __version__, compat

    lines = hpcg("--version").stdout.splitlines()
    assert lines[0] == f"hpc-garage {__version__}"
    for package, (low, high) in compat.VERIFIED.items():  # what the tests run on is verified (test_compat)
        assert f"{package} {compat.version(package)}: in the verified range >={low},<{high}" in lines


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["sites"], ["show", "--site", "slurm-gpu", "--nodes", "2"]])
def test_light_commands_do_not_import_heavy_libraries(args: list[str], tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hpc_garage", *args],
                          capture_output=True, text=True, env=clean_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_show_of_a_plain_site_does_not_import_pydantic(tmp_path: Path) -> None:
    """pydantic's import alone costs about as much as click's: `show` checks plain sites without it (siteview)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hpc_garage", "show", "--site", "lab-gpu",
                           "--nodes", "2", "--json"], capture_output=True, text=True, env=clean_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "pydantic" not in imported and "pydantic_core" not in imported


def test_status_finds_jobs_of_every_site_without_the_site_model(tmp_path: Path) -> None:
    """`status` and `status JOB` look in the default run root and in every site file's `run_directory` (read
    as written: a site broken elsewhere still shows its jobs) without importing pydantic or Dask: a fresh CLI
    every 10 s beside a running sweep must cost little."""
    import socket

    sites, elsewhere = tmp_path / "sites", tmp_path / "elsewhere"
    sites.mkdir()
    (sites / "broken.yaml").write_text(f"scheduler: slurm\nnode: {{cores: many}}\nrun_directory: {elsewhere}\n")
    env = clean_env(HOME=str(tmp_path / "home"), HPC_GARAGE_SITES_PATH=str(sites))
    ids = ["local-20260101-000000-1", "local-20260101-000001-1"]
    for root, job in zip((tmp_path / "home" / ".hpc-garage" / "runs", elsewhere), ids):
        (root / job).mkdir(parents=True)
        (root / job / "submit.json").write_text(json.dumps({"job_id": job, "scheduler": "local", "site": "broken",
                                                            "submitted": 1.0, "host": socket.gethostname()}))
    for args in (["status", "--json"], ["status", ids[1], "--json"]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hpc_garage", *args],
                              capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
        assert not imported & {"pydantic", "dask", *HEAVY}, imported & {"pydantic", "dask", *HEAVY}
    listed = json.loads(hpcg("status", "--json", env=env, cwd=tmp_path).stdout)
    assert sorted(v["job_id"] for v in listed) == ids
    assert json.loads(hpcg("status", ids[1], "--json", env=env, cwd=tmp_path).stdout)["job_id"] == ids[1]


def test_big_show_json_is_compact_and_the_same_object(tmp_path: Path) -> None:
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "big.yaml").write_text("scheduler: slurm\nnode: {cores: 64, memory: 512GiB, gpus: 8}\n"
                                    "workers: {per: gpu}\n")
    env = clean_env(HPC_GARAGE_SITES_PATH=str(sites))
    big = hpcg("show", "--site", "big", "--nodes", "200", "--json", env=env, cwd=tmp_path)
    small = hpcg("show", "--site", "big", "--nodes", "2", "--json", env=env, cwd=tmp_path)
    assert big.returncode == small.returncode == 0, big.stderr + small.stderr
    assert big.stdout.count("\n") == 1 and small.stdout.count("\n") > 100  # compact beyond 1,024 workers
    data = json.loads(big.stdout)
    assert len(data["workers"]) == 1600 and data["workers"][-1]["name"] == "n199-gpu7"
    assert data["workers"][:16] == json.loads(small.stdout)["workers"]


def test_run_refuses_a_file_of_secrets_that_is_missing_or_readable_by_others_in_one_line(tmp_path: Path) -> None:
    """A deployment's job names its API's secrets by $HPC_GARAGE_SECRETS (schedulers/flow_run_jobs.py)."""
    secrets = tmp_path / "s.json"
    for prepare, words in ((lambda: None, "no such file"),
                           (lambda: (secrets.write_text('{"X_TOKEN": "s3cret"}'), secrets.chmod(0o644)),
                            f"mode 644, owner uid {os.geteuid()}: a file of secrets must be yours and private; "
                            f"`chmod 600 {secrets}`"),
                           (lambda: (secrets.write_text('["x"]'), secrets.chmod(0o600)), "is not a JSON object")):
        prepare()
        done = hpcg("run", "--site", "local", "--", "true", env=clean_env(HOME=str(tmp_path),
                                                                          HPC_GARAGE_SECRETS=str(secrets)))
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"hpc-garage: error: HPC_GARAGE_SECRETS={secrets}") and words in done.stderr


@pytest.mark.slow
def test_run_hands_command_the_secrets_of_its_file(tmp_path: Path) -> None:
    secrets = tmp_path / "s.json"
    secrets.write_text('{"X_TOKEN": "s3cret"}')
    secrets.chmod(0o600)
    done = hpcg("run", "--site", "local", "--", sys.executable, "-c", "import os; print('got', os.environ['X_TOKEN'])",
                env=clean_env(HOME=str(tmp_path), HPC_GARAGE_SECRETS=str(secrets),
                              PREFECT_API_URL="http://127.0.0.1:9/api"), cwd=tmp_path)
    assert done.returncode == 0 and "got s3cret\n" in done.stdout, done.stdout + done.stderr[-2000:]
