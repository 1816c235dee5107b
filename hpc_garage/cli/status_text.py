"""How a terminal shows jobs: `status JOBID`'s lines, `status`'s table, where to look while a job runs (the
Prefect UI, the Dask dashboard, the `ssh -L` lines that reach them from a laptop) and `--wait`'s line rewritten
in place. The data comes from `schedulers/submission` (a JobView, its state in words) and its progress in words
from core/progress_text.py (shared with `--wait`'s summary and `run`'s report); only the look is here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from hpc_garage.core.progress_text import progress_text, search_text, sweep_text
from hpc_garage.core.tunnel import ssh_tunnel

if TYPE_CHECKING:
    from hpc_garage.schedulers.submission import JobView


def job_lines(view: JobView) -> list[str]:
    """`status JOBID`: the job's summary, then one `key: value` line each for what is known, then where to look
    while it runs."""
    data = view.to_dict(sweep=True)
    lines = [f"job {view.job_id} {data['summary']}"]
    batch = view.status
    details = {
        "site": data["site"],
        "name": data["name"],
        f"{view.batch.name} state": f"{batch.state}" + (f" ({batch.reason})" if batch.reason else "") if batch else "not in the queue",
        "nodes": batch.nodes if batch else None,
        "lost nodes": lost_nodes(data["run"]),
        "sweep": sweep_line(data["sweep"]),
        "sweep trials": sweep_text(data["sweep"]),
        "search": search_text(_search_summary(data["run_dir"])),
        "log": data["log"],
        "run directory": data["run_dir"],
    }
    progress = (data["run"] or {}).get("progress")
    if progress:
        details["trials"] = progress_text(progress)
    lines += [f"  {key + ':':<16}{value}" for key, value in details.items() if value]
    lines += [f"  {line}" for line in (progress_links(progress) if progress and not view.finished else ())]
    return lines


def _search_summary(run_dir: str | None) -> dict[str, Any] | None:
    """The job's search.json (hpc_garage.search), where it ran one."""
    from pathlib import Path

    from hpc_garage.files import read_json
    from hpc_garage.rundir import RunDir

    return read_json(RunDir(Path(run_dir)).search_summary) if run_dir else None


def jobs_table(views: list[JobView]) -> list[str]:
    """`status`: one line per job, newest first."""
    if not views:
        return ["no jobs: none that hpc-garage submitted or ran still has a run directory"]
    lines = [f"{'JOBID':<12} {'SITE':<14} {'NAME':<20} {'SUBMITTED':<17} STATE"]
    for v in views:
        d = v.to_dict()
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(d["submitted"])) if d["submitted"] else "-"
        lines.append(f"{v.job_id:<12} {d['site'] or '-':<14} {(d['name'] or '-')[:20]:<20} {when:<17} {d['summary']}")
    return lines


def sweep_line(sweep: dict[str, Any] | None) -> str | None:
    """e.g. `lr-scan-2f0c… epoch 1: 14 results kept; jobs 93 (submit), 98 (follow-up)`."""
    if not sweep:
        return None
    jobs = ", ".join(f"{j['job_id']} ({j['how']})" for j in sweep["jobs"])
    return f"{sweep['name']} epoch {sweep['epoch']}: {sweep['results']} results kept; jobs {jobs}"


def lost_nodes(run: dict[str, Any] | None) -> str | None:
    """state.json's lost nodes (cluster/node_loss.py), e.g. `node2 at 23:41:07 (killed by signal 9; restarted)`."""
    lost = (run or {}).get("lost_nodes") or []
    return "; ".join(f"{x.get('host')} at {time.strftime('%H:%M:%S', time.localtime(x.get('at', 0)))} ({x.get('why')}"
                     + ("; restarted)" if x.get("restarted") else ")") for x in lost) or None


def progress_links(progress: dict[str, Any], login: str | None = None) -> list[str]:
    """Where to look while it runs: the Prefect flow run(s) in the UI, the Dask dashboard and the `ssh -L`
    line that reaches it from a laptop through this (login) node."""
    import getpass
    import socket
    from urllib.parse import urlsplit

    lines = []
    login = login or f"{getpass.getuser()}@{socket.getfqdn()}"
    prefect = progress.get("prefect") or {}
    for run in prefect.get("flow_runs") or []:
        where = run.get("url") or run.get("id")
        if prefect.get("ui") is False:
            lines.append(f"Prefect flow run {run.get('id')} (the Prefect server at {prefect.get('api')} runs "
                         "without its UI; set PREFECT_API_URL to a server with one to browse it)")
        else:
            lines.append(f"Prefect UI: {where}")
    managed, runs = prefect.get("server"), prefect.get("flow_runs") or []
    if managed and runs and prefect.get("ui") is not False:  # hpc-garage's server: on a node, behind its auth
        page = urlsplit(str(runs[-1].get("url") or ""))
        if page.hostname and page.port:
            lines.append(f"  from a laptop: {ssh_tunnel(page.hostname, page.port, login, page.path)}")
        bind, machine = managed.get("host") or "127.0.0.1", managed.get("machine")
        flags = "" if bind in ("127.0.0.1", "localhost") else f" --host {bind}"
        flags += f" --machine {machine}" if machine and machine != socket.gethostname().split(".")[0] else ""
        lines.append(f"  the UI's login asks for the server's auth string: `hpc-garage server auth{flags}` prints it")
    if dashboard := progress.get("dashboard"):
        host, port = dashboard.get("host"), dashboard.get("port")
        lines.append(f"Dask dashboard: http://{host}:{port}/status" + (
            "" if dashboard.get("bokeh", True) else " (the job's Python lacks bokeh: `pip install bokeh` there for the plots)"))
        lines.append(f"  from a laptop: {ssh_tunnel(str(host), int(port), login, '/status', local_port=8787)}")
    return lines


@dataclass
class ProgressLine:
    """One line rewritten in place on a terminal; one line per change elsewhere (logs, pipes). `note` prints
    a line that stays (above the one rewritten)."""

    stream: IO[str]

    def __call__(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}" if self.stream.isatty() else f"{text}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}\n" if self.stream.isatty() else f"{text}\n")
        self.stream.flush()


def progress_line(stream: IO[str]) -> ProgressLine:
    return ProgressLine(stream)
