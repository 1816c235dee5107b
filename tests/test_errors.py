"""The errors contract (README "Errors"): every bad input is one line on stderr naming where it came from,
exit 2, no traceback, and nothing left behind: no job, no run directory, no file, no process.

Each command is run for real (`python -m hpc_garage`), with a fresh HOME (where run directories and the
Prefect server's state would go) and a fresh working directory, both of which must stay empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_garage.core.errors import UserError

SCRIPT = "flow.py"


def _run(args: list[str], home: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_GARAGE_", "SLURM_", "PBS_"))}
    environment |= {"HOME": str(home), **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpc_garage", *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=60)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / SCRIPT).write_text("print('hi')\n")
    (work / "run.sh").write_text("#!/bin/bash\necho hi\n")
    (work / "adir").mkdir()
    lab = (Path(__file__).resolve().parent.parent / "site-configs" / "lab-gpu.yaml").read_text()
    (work / "missing-results.yaml").write_text(lab + f"results_directory: {tmp_path / 'no' / 'such'}\n")
    (work / "file-results.yaml").write_text(lab + f"results_directory: {work / SCRIPT}\n")
    pbs = (Path(__file__).resolve().parent.parent / "site-configs" / "lab-pbs.yaml").read_text()
    (work / "signal-pbs.yaml").write_text(pbs + "warning_signal: USR1@60\n")
    (work / "latin.yaml").write_bytes(b"scheduler: local\nnode: {cores: 2, memory: 4GiB}\ndescription: caf\xe9\n")
    return home, work


# (arguments, a fragment the one line must hold: the flag, variable or file it names, or the bad value)
BAD = [
    # show: the site and each request flag
    (["show", "--site", "nosuch"], "unknown site 'nosuch'"),
    (["show", "--site", "lab-gpuu"], "did you mean 'lab-gpu'"),
    (["show", "--site", "adir/"], "is a directory"),
    (["show", "--site", "latin.yaml"], "not UTF-8"),
    (["show", "--site", "lab-gpu", "--nodes", "x"], "--nodes"),
    (["show", "--site", "lab-gpu", "--nodes", "0"], "--nodes 0"),
    (["show", "--site", "lab-gpu", "--nodes", "99999999999999999999"], "--nodes"),
    (["show", "--site", "lab-gpu", "--nodes", "2", "--nodes", "3"], "--nodes given twice"),
    (["show", "--site", "lab-gpu", "--gpus-per-node", "-1"], "--gpus-per-node -1"),
    (["show", "--site", "lab-gpu", "--gpus-per-node", "99"], "--gpus-per-node 99"),
    (["show", "--site", "lab-gpu", "--cores-per-node", "0"], "--cores-per-node 0"),
    (["show", "--site", "lab-gpu", "--mem", "lots"], "--mem"),
    (["show", "--site", "lab-gpu", "--mem", "1e400"], "beyond any machine"),
    (["show", "--site", "lab-gpu", "--mem", "999TiB"], "--mem"),
    (["show", "--site", "lab-gpu", "--time", "25:99:00"], "99 minutes"),
    (["show", "--site", "lab-gpu", "--time", "90.0"], "ambiguous"),
    (["show", "--site", "lab-gpu", "-t", "2h", "--time", "3h"], "given twice"),
    (["show", "--site", "lab-gpu", "--json", "--script"], "exclude each other"),
    (["show", "--site", "lab-gpu", SCRIPT], "--script"),
    (["show", "--site", "lab-gpu", "--worker-script"], "submits no worker jobs"),
    (["show", "--site", "lab-jobqueue", "--nodes", "2"], "--nodes"),
    (["show", "--bogus"], "No such option"),
    # run
    (["run"], "COMMAND"),
    (["run", "--timeout", "nan", "--", "true"], "--timeout"),
    (["run", "--timeout", "0", "--", "true"], "--timeout"),
    (["run", "--", "no-such-program-here"], "command not found"),
    (["run", "--site", "nosuch", "--", "true"], "unknown site"),
    # submit: every request flag, the script, and values that reach the job script
    (["submit", "--site", "lab-gpu", "--dry-run", "nope.py"], "does not exist"),
    (["submit", "--site", "lab-gpu", "--dry-run", "run.sh"], "not a Python script"),
    (["submit", "--site", "lab-gpu", "--dry-run", "adir"], "is a directory"),
    (["submit", "--site", "local", SCRIPT], "is local"),
    (["submit", "--site", "lab-gpu", "--nodes", "9999", SCRIPT], "--nodes 9999"),
    (["submit", "--site", "lab-gpu", "--time", "soon", SCRIPT], "--time"),
    (["submit", "--site", "lab-gpu", "--mem", "-5G", SCRIPT], "--mem"),
    (["submit", "--site", "lab-gpu", "--account", "a b", SCRIPT], "--account 'a b'"),
    (["submit", "--site", "lab-gpu", "--account", "$(id)", SCRIPT], "--account"),
    (["submit", "--site", "lab-gpu", "--qos", "x;y", SCRIPT], "--qos"),
    (["submit", "--site", "lab-gpu", "--job-name", "a b", SCRIPT], "job name 'a b'"),
    (["submit", "--site", "lab-gpu", "--job-name", "x", "-J", "y", SCRIPT], "given twice"),
    (["submit", "--site", "pbs-gpu", "--qos", "high", SCRIPT], "PBS has no QOS"),
    # sweeps (issue 10)
    (["submit", "--site", "lab-gpu", "--sweep", "../x", SCRIPT], "--sweep '../x' is not a sweep name"),
    (["submit", "--site", "lab-gpu", "--sweep", "a b", SCRIPT], "--sweep 'a b' is not a sweep name"),
    (["submit", "--site", "lab-gpu", "--resume", SCRIPT], "has not run yet"),
    (["submit", "--site", "missing-results.yaml", SCRIPT], "missing-results.yaml: results_directory"),
    (["submit", "--site", "file-results.yaml", SCRIPT], "is not a directory"),
    (["show", "--site", "signal-pbs.yaml"], "warning_signal"),
    (["run", "--sweep", "/etc", "--", "true"], "--sweep '/etc' is not a sweep name"),
    (["run", "--resume", "--", "true"], "has not run yet"),
    (["run", "--sweep-epoch", "2", "--", "true"], "--sweep-epoch needs --sweep"),
    (["run", "--site", "missing-results.yaml", "--", "true"], "results_directory"),
    (["resume", "nosuch"], "no sweep 'nosuch'"),
    (["resume", "../x"], "not a sweep name"),
    (["resume", "12345"], "no sweep '12345'"),
    # sbatch's options
    (["sbatch", "--gress=gpu:2", SCRIPT], "did you mean --gres?"),
    (["sbatch", "-N", "x", SCRIPT], "-N x"),
    (["sbatch", "--mem=lots", SCRIPT], "--mem lots"),
    (["sbatch", "-n", "4", SCRIPT], "-n"),
    (["sbatch", "--array=1-3", SCRIPT], "arrays"),
    (["sbatch", "--site", "lab-cpu", "-p", "gpu", SCRIPT], "-p gpu"),
    (["sbatch", "--site", "lab-pbs", SCRIPT], "hpc-garage submit --site"),
    (["sbatch", "--nodes", "1", "--nodes", "2", SCRIPT], "given twice"),
    (["sbatch"], "no script"),
    # following jobs
    (["status", "../x"], "not a job id"),
    (["cancel", "a b"], "not a job id"),
    (["logs", "../../etc"], "not a job id"),
    (["status", "--site", "nosuch", "12"], "unknown site"),
    (["server", "status", "--host", "../../x"], "--host"),
    (["server", "stop", "--host", "a b"], "--host"),
    (["nosuch"], "No such command"),
]


@pytest.mark.parametrize(("args", "fragment"), BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(args: list[str], fragment: str,
                                                          places: tuple[Path, Path]) -> None:
    home, work = places
    before = _files(work)
    done = _run(args, home, work)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and lines[0].startswith("hpc-garage: error: "), done.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert _files(home) == [], "files left in HOME"
    assert _files(work) == before, "files left in the working directory"


BAD_VARIABLES = [
    ({"HPC_GARAGE_WORKER_PRELOAD": "no_such_module_here"}, ["run", "--", "true"], "HPC_GARAGE_WORKER_PRELOAD"),
    ({"HPC_GARAGE_SITE": "nosuch"}, ["run", "--", "true"], "unknown site"),
    ({"HPC_GARAGE_SITES_PATH": "/nonexistent", "HPC_GARAGE_SITE": "x"}, ["show"], "unknown site 'x'"),
    ({"SLURM_JOB_ID": "../x", "SLURM_JOB_NODELIST": "n1", "SLURM_CPUS_ON_NODE": "4"},
     ["show", "--site", "lab-cpu"], "SLURM_JOB_ID='../x'"),
    ({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_CPUS_ON_NODE": "4", "SLURM_MEM_PER_NODE": "4000",
      "SLURM_GPUS_ON_NODE": "x"}, ["show", "--site", "lab-gpu"], "SLURM_GPUS_ON_NODE"),
]


@pytest.mark.parametrize(("env", "args", "fragment"), BAD_VARIABLES, ids=[next(iter(e)) for e, _, _ in BAD_VARIABLES])
def test_bad_variables_are_named_in_one_line(env: dict[str, str], args: list[str], fragment: str,
                                             places: tuple[Path, Path]) -> None:
    home, work = places
    done = _run(args, home, work, env)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and fragment in lines[0], done.stderr
    assert _files(home) == []


# ---- scheduler files handed to a flow: foreign, stale, corrupt, a directory: task_runner() refuses them

READ_HANDOFF = """
import os
import sys
import hpc_garage
from hpc_garage.core.errors import UserError
if "HPC_GARAGE_START_TIMEOUT" not in os.environ:
    os.environ["HPC_GARAGE_START_TIMEOUT"] = "1"  # a missing file: fail fast
try:
    hpc_garage.task_runner()  # what a flow does first: it reads the scheduler file before anything starts
except UserError as exc:
    print(exc, file=sys.stderr)
    sys.exit(2)
print("accepted")
"""


def _scheduler_file(path: Path, job_id: str = "123", **extra: object) -> Path:
    data = {"type": "Scheduler", "address": "tls://127.0.0.1:1",
            "hpc_garage": {"job_id": job_id, "tls": None, "workers": [], **extra}}
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("case", ["foreign job", "stale writer", "credentials gone", "corrupt", "not an object",
                                  "a directory", "bad timeout variable"])
def test_bad_scheduler_files_are_one_line(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a flow does first (READ_HANDOFF, in this process: Prefect imported once for all the cases)."""
    import hpc_garage

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_GARAGE_", "SLURM_", "PBS_"))}
    env["HOME"] = str(tmp_path)
    path = tmp_path / "scheduler.json"
    expect = {"foreign job": "belongs to job 123, not this job 456", "stale writer": "is stale",
              "credentials gone": "credentials are gone", "corrupt": "not valid JSON",
              "not an object": "not an hpc-garage scheduler file", "a directory": "is a directory",
              "bad timeout variable": "HPC_GARAGE_START_TIMEOUT"}[case]
    if case == "foreign job":
        _scheduler_file(path)
        env |= {"SLURM_JOB_ID": "456"}  # a batch job of its own: another job's file is not its cluster
    elif case == "stale writer":
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        _scheduler_file(path, host=os.uname().nodename, pid=int(dead.stdout))
    elif case == "credentials gone":
        _scheduler_file(path, tls={"tls_ca_file": str(tmp_path / "tls" / "cert.pem")})
    elif case == "corrupt":
        path.write_text('{"address": ')  # refused after handoff.HALF_WRITTEN_SECONDS, not the start timeout
    elif case == "not an object":
        path.write_text("[1, 2]")
    elif case == "a directory":
        path.mkdir()
    elif case == "bad timeout variable":
        _scheduler_file(path)
        env |= {"HPC_GARAGE_START_TIMEOUT": "nan"}
    env["HPC_GARAGE_SCHEDULER_FILE"] = str(path)
    env.setdefault("HPC_GARAGE_START_TIMEOUT", "1")  # a missing file: fail fast
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as refused:
        hpc_garage.task_runner()  # it reads the scheduler file before anything starts
    assert refused.value.exit_code == 2, refused.value
    lines = str(refused.value).splitlines()
    assert len(lines) == 1 and expect in lines[0], str(refused.value)
    assert not (tmp_path / ".hpc-garage").exists()  # no Prefect server was started for a flow that cannot run


def test_a_good_scheduler_file_of_this_job_is_accepted(tmp_path: Path) -> None:
    """The refusals above are not everything being refused."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_GARAGE_", "SLURM_", "PBS_"))}
    path = _scheduler_file(tmp_path / "scheduler.json", job_id="456", host=os.uname().nodename, pid=os.getpid())
    env |= {"HOME": str(tmp_path), "HPC_GARAGE_SCHEDULER_FILE": str(path), "SLURM_JOB_ID": "456",
            "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # an API of the user's: no managed server is started
    done = subprocess.run([sys.executable, "-c", READ_HANDOFF], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "accepted", done.stderr
    assert not (tmp_path / ".hpc-garage").exists()  # the fast layer starts no Prefect server


@pytest.mark.slow
def test_run_hands_command_its_own_scheduler_file_not_one_from_the_environment(tmp_path: Path) -> None:
    foreign = _scheduler_file(tmp_path / "foreign.json", job_id="123")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_GARAGE_", "SLURM_", "PBS_"))}
    env |= {"HOME": str(tmp_path), "HPC_GARAGE_SCHEDULER_FILE": str(foreign)}
    show = "import os; from hpc_garage.cluster.handoff import handoff_from_env; h = handoff_from_env(); " \
           "print(os.environ['HPC_GARAGE_SCHEDULER_FILE'], h.job_id)"
    done = subprocess.run([sys.executable, "-m", "hpc_garage", "run", "--", sys.executable, "-c", show],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    path, job_id = done.stdout.split()[-2:]
    assert path != str(foreign) and path.endswith("scheduler.json") and job_id.startswith("local-")


# ---- a flow handed a stale scheduler file (the job that wrote it has ended): one line, exit 2, however started

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "examples" / "sweep.py"  # `@flow(task_runner=hpc_garage.task_runner())`, as users write it


def _stale_scheduler_file(tmp_path: Path) -> Path:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return _scheduler_file(tmp_path / "scheduler.json", host=os.uname().nodename, pid=int(dead.stdout))


def _stale_line(stderr: str, path: Path) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("hpc-garage: error:")]
    assert ours == [f"hpc-garage: error: scheduler file {path} is stale: the `hpc-garage run` that wrote it "
                    f"(pid {json.loads(path.read_text())['hpc_garage']['pid']}) has ended; rerun the job, or delete "
                    "the file"], stderr[-3000:]


def test_python_sweep_py_with_a_stale_scheduler_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """The refusal comes as the flow is decorated, at the top of the user's script: no traceback."""
    stale = _stale_scheduler_file(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_GARAGE_", "SLURM_", "PBS_"))}
    env |= {"HOME": str(tmp_path), "HPC_GARAGE_SCHEDULER_FILE": str(stale)}
    done = subprocess.run([sys.executable, str(SWEEP), "--seeds", "1"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    _stale_line(done.stderr, stale)
    assert done.stderr.splitlines() == [f"hpc-garage: error: {done.stderr.split('error: ', 1)[1].strip()}"]
    assert not (tmp_path / ".hpc-garage").exists()  # nothing started: no Prefect server, no run directory


@pytest.mark.slow
def test_a_flow_under_run_handed_a_stale_scheduler_file_ends_in_one_line_and_run_exits_2(tmp_path: Path) -> None:
    """COMMAND's one line among `run`'s own; `run` exits with COMMAND's 2. (`run` hands COMMAND its own file:
    here COMMAND is pointed at the stale one, as a wrapper script of the user's might.)"""
    stale = _stale_scheduler_file(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_GARAGE_", "SLURM_", "PBS_"))}
    env |= {"HOME": str(tmp_path)}
    command = ["env", "-u", "HPC_GARAGE_JOB_ID", f"HPC_GARAGE_SCHEDULER_FILE={stale}", sys.executable, str(SWEEP)]
    done = subprocess.run([sys.executable, "-m", "hpc_garage", "run", "--", *command], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    _stale_line(done.stderr, stale)
