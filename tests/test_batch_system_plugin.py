"""A new batch system is one class and one job-script template: an LSF-like one, defined here and registered,
goes through `show --script`, submit's argv, status parsing and the job's allocation read from its
environment, with no other module of hpc-garage changed (schedulers/base.py and the registry are its API).

The class answers its own commands (`run`), so nothing is submitted; what hpc-garage asked is in `calls`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import hpc_garage.schedulers as schedulers
from hpc_garage.core import site_values
from hpc_garage.core.allocation import Allocation, NodeAllocation
from hpc_garage.core.errors import UserError
from hpc_garage.core.units import mib
from hpc_garage.schedulers import job_env, submission
from hpc_garage.schedulers.base import BatchSystem, JobStatus, fallback_memory, require, site_gpus, visible_gpus

TEMPLATE = """\
#!/bin/bash
#BSUB -J ${job_name}
#BSUB -n ${slots}
#BSUB -R "span[ptile=${per_node}] rusage[mem=${memory}]"
#BSUB -W ${walltime}
#BSUB -o ${output}
${directives}
${body}
"""

_STATES = {"PEND": "pending", "PSUSP": "pending", "RUN": "running", "USUSP": "running", "DONE": "finished",
           "EXIT": "finished"}


def lsf(template_file: Path) -> type[BatchSystem]:
    """The whole batch system: what it spells, its commands, how its job's environment reads."""

    class Lsf(BatchSystem):
        name = "lsf"
        job_id_variable = "LSB_JOBID"
        template = str(template_file)  # a plugin's own template: an absolute path
        directive_prefix = "#BSUB"
        submit_command = "bsub"
        calls: list[list[str]] = []  # the commands hpc-garage ran, shared by every instance `get` makes
        answers: dict[str, str] = {"bsub": "Job <77> is submitted to queue <normal>.\n", "bkill": ""}

        def run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60) -> str:
            self.calls.append(list(argv))
            return self.answers.get(argv[0], "")

        def template_values(self, spec: Any) -> dict[str, Any]:
            from hpc_garage.schedulers.directive_values import path_value, plain

            hours, minutes = divmod(max(60, spec.walltime) // 60, 60)
            return {"job_name": spec.job_name, "slots": str(spec.nodes * spec.tasks_per_node),
                    "per_node": str(spec.tasks_per_node), "memory": f"{max(1, mib(spec.memory))}",
                    "walltime": f"{hours}:{minutes:02d}", "output": path_value(spec.output, "-o", quote=False),
                    "directives": [f"-q {plain(spec.queue, 'queue')}"] * bool(spec.queue) + list(spec.directives)}

        def default_output(self, run_root: Path, job_name: str) -> str:
            return str(run_root / "%J.out")

        def log_path(self, pattern: str, job_id: str, job_name: str) -> str:
            return pattern.replace("%J", job_id)

        def submit_argv(self, script: Path, spec: Any) -> list[str]:
            return ["bsub", "-cwd", spec.workdir, str(script)]

        def parse_job_id(self, output: str) -> str:
            found = re.search(r"Job <(\d+)> is submitted", output)
            if not found:
                raise UserError(f"bsub printed {output!r} instead of a job id; check the queue")
            return found.group(1)

        def status(self, job_id: str) -> JobStatus | None:
            line = self.run(["bjobs", "-noheader", "-o", "jobid stat job_name exec_host exit_code delimiter='|'",
                             job_id]).strip()
            if not line:
                return None
            _, state, name, hosts, code = (line.split("|") + [""] * 5)[:5]
            phase = _STATES.get(state, "running")
            return JobStatus(job_id=job_id, state=state, phase=phase, name=name, nodes=hosts or None,
                             exit_code=(int(code) if code.isdigit() else 0) if phase == "finished" else None)

        def cancel_argv(self, job_id: str) -> list[str]:
            return ["bkill", job_id]

        def allocation_from_env(self, env: Mapping[str, str], site: Any) -> Allocation:
            job_id = self.job_id(env) or require(env, "LSB_JOBID", "this is not an LSF job")
            words = require(env, "LSB_MCPU_HOSTS", "the job's hosts are unknown").split()
            gpus, notes = visible_gpus(env, site.node.gpu_vendor, expected=site_gpus(site))
            memory, note = fallback_memory(site.node.memory, site.name, "LSF says no memory", limit=lambda: None)
            nodes = tuple(NodeAllocation(host=host, cores=int(slots), memory=memory, gpus=gpus)
                          for host, slots in zip(words[::2], words[1::2]))
            return Allocation(nodes=nodes, source=self.name, job_id=job_id, notes=(*notes, note))

    return Lsf


@pytest.fixture
def system(tmp_path: Path, site_dir: Path, monkeypatch: pytest.MonkeyPatch) -> type[BatchSystem]:
    """The LSF-like system registered for this test alone, a site `lsf1` of it, and a script in tmp_path/work."""
    monkeypatch.setattr(schedulers, "_SYSTEMS", dict(schedulers._SYSTEMS))  # undone after the test
    for table in ("BATCH_SYSTEMS", "SIGNALS_BEFORE_END", "LAUNCHES_RANKS", "TAKES_JOBS", "WORKER_JOBS"):
        monkeypatch.setattr(site_values, table, list(getattr(site_values, table)))
    monkeypatch.setattr(job_env, "JOB_ID_VARIABLES", list(job_env.JOB_ID_VARIABLES))
    (tmp_path / "lsf.sh").write_text(TEMPLATE)
    cls = schedulers.register(lsf(tmp_path / "lsf.sh"))
    (site_dir / "lsf1.yaml").write_text(
        f"scheduler: lsf\nqueue: normal\nrun_directory: {tmp_path}/runs\n"
        "node:\n  cores: 8\n  memory: 16GiB\nworkers:\n  per: process\n  processes: 2\n")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "flow.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path / "work")
    cls.calls.clear()
    return cls


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from hpc_garage.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


def test_a_site_may_name_it_only_once_it_is_registered(tmp_path: Path, site_dir: Path) -> None:
    from hpc_garage.core.errors import SiteError
    from hpc_garage.sites import load_site

    (site_dir / "lsf1.yaml").write_text("scheduler: lsf\nnode:\n  cores: 8\n  memory: 16GiB\n")
    with pytest.raises(SiteError, match=r"scheduler 'lsf' is not a batch system hpc-garage knows; use one of "
                                        r"slurm, pbs, local"):
        load_site("lsf1")
    with pytest.raises(UserError, match="scheduler 'lsf' is not a batch system hpc-garage knows"):
        schedulers.get("lsf")


def test_show_script_renders_its_template(system: type[BatchSystem], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["show", "--site", "lsf1", "--script", "--nodes", "2", "--time", "1:30:00"], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:6] == ["#!/bin/bash", "#BSUB -J SCRIPT", "#BSUB -n 4",
                         '#BSUB -R "span[ptile=2] rusage[mem=16384]"', "#BSUB -W 1:30",
                         f"#BSUB -o {tmp_path}/runs/%J.out"]
    assert lines[6] == "#BSUB -q normal"
    assert any("-m hpc_garage run --site" in line and "lsf1.yaml" in line for line in lines)
    assert not any(line.startswith(("#SBATCH", "#PBS")) for line in lines)
    assert system.calls == []  # showing runs none of its commands


def test_submit_hands_its_argv_to_it_and_records_the_job(system: type[BatchSystem], tmp_path: Path) -> None:
    prepared = submission.prepare("lsf1", "flow.py")
    done = submission.submit(prepared)
    [argv] = system.calls
    assert argv[:3] == ["bsub", "-cwd", str(tmp_path / "work")] and argv[3].endswith(".sh")
    assert done.job_id == "77" and done.log == f"{tmp_path}/runs/77.out"
    assert (tmp_path / "runs" / "77" / "job.sh").read_text() == prepared.script
    assert prepared.script.startswith("#!/bin/bash\n#BSUB -J flow\n")
    assert done.record["scheduler"] == "lsf"


@pytest.mark.parametrize("answer, phase, exit_code", [("77|PEND|flow||", "pending", None),
                                                      ("77|RUN|flow|n1|", "running", None),
                                                      ("77|EXIT|flow|n1|3", "finished", 3)])
def test_status_is_parsed_by_it(system: type[BatchSystem], answer: str, phase: str, exit_code: int | None,
                                capsys: pytest.CaptureFixture[str]) -> None:
    submission.submit(submission.prepare("lsf1", "flow.py"))
    system.answers["bjobs"] = answer + "\n"
    view = submission.lookup("77")  # found by its run directory, whose record names the system
    assert view.batch.name == "lsf" and view.status is not None
    assert (view.status.state, view.status.phase, view.status.exit_code) == (answer.split("|")[1], phase, exit_code)
    assert system.calls[-1][0] == "bjobs" and system.calls[-1][-1] == "77"
    code, out, err = run_cli(["status", "77"], capsys)
    assert code == 0 and "77" in out and answer.split("|")[1] in out


def test_the_job_reads_its_allocation_from_its_environment(system: type[BatchSystem],
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_garage.sites import load_site

    env = {"LSB_JOBID": "77", "LSB_MCPU_HOSTS": "n1 8 n2 8", "PATH": "/usr/bin"}
    assert schedulers.in_batch_job(env) and schedulers.job_id(env) == "77"
    assert job_env.job_id(env) == "77"  # what the flow's side reads (a scheduler file of another job is refused)
    site = load_site("lsf1")
    allocation = schedulers.allocation_from_env(site, env)
    assert [(n.host, n.cores) for n in allocation.nodes] == [("n1", 8), ("n2", 8)]
    assert (allocation.source, allocation.job_id) == ("lsf", "77")
    assert schedulers.for_allocation(allocation).name == "lsf"
    assert schedulers.allocation_for(site, env=env) == allocation  # inside the job, nothing requested: its own
    for name in [*env, "SLURM_JOB_ID", "PBS_JOBID"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = run_cli(["show", "--site", "lsf1"], capsys)  # `show` inside the job lays out its allocation
    assert code == 0 and "n1" in out and "n2" in out, out + err


def test_what_it_cannot_do_is_refused_in_one_line(system: type[BatchSystem]) -> None:
    batch = schedulers.get("lsf")
    assert batch.takes_jobs and not batch.launches_ranks and batch.wind_down_argv("77") is None
    with pytest.raises(UserError, match="launcher jobqueue needs a batch system dask-jobqueue submits to "
                                        r"\(slurm, pbs\), not lsf; use launcher: mpi"):
        batch.jobqueue_classes()


def test_a_site_is_checked_against_its_systems_capabilities_not_its_name(
        system: type[BatchSystem], site_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_garage.core.errors import SiteError
    from hpc_garage.sites import load_site

    site = "scheduler: lsf\nnode:\n  cores: 8\n  memory: 16GiB\n"
    (site_dir / "lsf2.yaml").write_text(site + "warning_signal: USR1@60\nmpi:\n  launch: srun\n")
    with pytest.raises(SiteError, match=r"warning_signal asks the batch system for a signal before the job's end, "
                                        r"which 'lsf' does not send \(slurm does\)"):
        load_site("lsf2")
    (site_dir / "lsf2.yaml").write_text(site + "mpi:\n  launch: srun\n")
    with pytest.raises(SiteError, match=r"mpi.launch: srun needs a batch system that launches the ranks itself "
                                        r"\(slurm\), and scheduler is 'lsf'"):
        load_site("lsf2")
    monkeypatch.setattr(system, "signals_before_end", True)
    monkeypatch.setattr(system, "launches_ranks", True)
    schedulers.register(system)  # the same system, now saying it can
    (site_dir / "lsf2.yaml").write_text(site + "warning_signal: USR1@60\nmpi:\n  launch: srun\n")
    assert load_site("lsf2").scheduler == "lsf"


def test_the_site_models_table_says_what_each_built_in_system_says_of_itself() -> None:
    for name in ("slurm", "pbs", "local"):
        batch = schedulers.get(name)
        assert (name in site_values.SIGNALS_BEFORE_END) == batch.signals_before_end, name
        assert (name in site_values.LAUNCHES_RANKS) == batch.launches_ranks, name
        assert (name in site_values.TAKES_JOBS) == batch.takes_jobs, name
        assert (name in site_values.WORKER_JOBS) == bool(batch.jobqueue_job and batch.jobqueue_cluster), name
