"""How far the sweep has got, read where it is known (the Dask scheduler), and the record its report is made of.

`install(scheduler, ...)` adds `RunProgress`, a SchedulerPlugin, to the scheduler `hpc-garage run` starts
(every launcher), and registers `launchers.gpu_sampler.TrialSampler` for every worker that joins. Every
PROGRESS_SECONDS it hands `write` the figures `submit --wait` and `status` show (run.py keeps them in
state.json under "progress"):
- trials (Dask tasks: one per Prefect task run) done, running (executing on a worker, as the workers'
  heartbeats say), failed (erred, or a Prefect Failed/Crashed state, as the worker's sampler says), waiting
  (known to the scheduler, not started);
- GPUs busy (GPU workers executing something) out of GPUs allocated (the workers' `GPU` resources);
- elapsed seconds and a simple ETA (trials left at the rate trials have finished so far);
- where to look: the Dask dashboard, and the Prefect flow run(s), found from a task key
  (`<task name>-<task run id hex>`, prefect/fast.py) through the API's `/task_runs/{id}` with hpc-garage's
  plain HTTP client (hpc_garage/prefect_api.py: this layer does not import Prefect).
What the trials reported (the run directory's trials.json, cluster/trial_metrics.py) is in the progress too
("metrics": reporting, pruned, the best trial), read only when the file changed. At the end, `finish()` turns
the record into the efficiency report (cluster/report.py): each trial's span as its worker's sampler timed it
(Dask's startstops where no sampler spoke); cluster/artifacts.py then leaves the report's GPU figures and
what the trials reported on their Prefect task runs and flow runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from hpc_garage.cluster.finished_trials import RECENT, FinishedTrials, TrialRecord
from hpc_garage.cluster.handoff import announced_trials
from hpc_garage.cluster.report import TASK_RUN_ID, Trials
from hpc_garage.compat import trim_span_metadata
from hpc_garage.cluster.trial_metrics import Watch
from hpc_garage.launchers.gpu_sampler import NAME as SAMPLER_NAME, TOPIC, TrialSampler
from hpc_garage.prefect_api import PrefectApi
from hpc_garage.variables import PREFECT_SERVER_ENV

if TYPE_CHECKING:
    from distributed import Scheduler

    from hpc_garage.rundir import RunDir

__all__ = ["NAME", "PROGRESS_SECONDS", "RunProgress", "install", "managed_server", "prefect_ui_url"]

NAME = "hpc-garage-progress"
PROGRESS_SECONDS = 2.0
TICK_SECONDS = 1.0  # memory peaks are read this often (the workers' heartbeats update them)


@dataclass
class WorkerRecord:
    name: str
    gpus: float  # its GPU resource
    memory_limit: int
    nthreads: int
    joined: float
    left: float | None = None
    memory_peak: int = 0
    gpu_ids: list[str] = field(default_factory=list)


def _interrupted(ts: Any) -> bool:
    """Whether an erred task raised hpc_garage.trial.Interrupted (Dask keeps the exception's repr)."""
    return str(getattr(ts, "exception_text", "") or "").startswith("Interrupted(")


async def install(scheduler: Scheduler, write: Callable[[dict[str, Any]], None], *, vendor: str = "nvidia",
                  api: Mapping[str, str] | None = None, noted: Callable[[], list[str]] | None = None,
                  metrics: Path | None = None, spool_dir: Path | None = None) -> RunProgress:
    """Progress on this scheduler, and the GPU sampler on every worker that joins it (before they start).
    `noted`: the flow runs COMMAND's task runners noted (cluster/handoff.py), known before any trial ends;
    `metrics`: the run directory's trials.json (RunDir.metrics_summary), what the trials reported;
    `spool_dir`: where finished trials' records wait for the report (cluster/finished_trials.py)."""
    from distributed.protocol.pickle import dumps

    plugin = RunProgress(write, api=api, noted=noted, metrics=metrics, spool_dir=spool_dir)
    scheduler.add_plugin(plugin, name=NAME)
    plugin.attach(scheduler)
    await scheduler.register_worker_plugin(None, dumps(TrialSampler(vendor)), name=SAMPLER_NAME, idempotent=True)
    return plugin


class RunProgress(SchedulerPlugin):
    """See the module docstring. One instance per scheduler."""

    name = NAME

    def __init__(self, write: Callable[[dict[str, Any]], None], *, api: Mapping[str, str] | None = None,
                 noted: Callable[[], list[str]] | None = None, metrics: Path | None = None,
                 spool_dir: Path | None = None) -> None:
        self.write = write
        self.metrics = Watch(metrics) if metrics is not None else None  # trials.json, read when it changed
        self.api = dict(api or {})
        self.noted = noted or list
        self.scheduler: Any = None
        self.started = time.time()
        self.first_task: float | None = None
        self.pending: set[str] = set()  # known to the scheduler, not finished (bounded by the work in flight)
        self.most_known = 0  # the most trials known at once: a COMMAND stopped mid-sweep forgets the rest
        self.trials = FinishedTrials(spool_dir)  # the latest in memory, the rest in a file till the report
        self.sampled: OrderedDict[str, dict[str, Any]] = OrderedDict()  # key → the worker's sampler event,
        # until its record comes (the latest RECENT: one whose record never comes is not kept for ever)
        self.workers: dict[str, WorkerRecord] = {}  # by address
        self.flow_runs: list[str] = []
        self.interrupted: list[dict[str, Any]] = []  # trials the job's end interrupted (cluster/wind_down.py)
        self.looked_up: set[str] = set()
        self.ui: bool | None = None  # whether the API's server serves its UI (None: not asked yet)
        self.lookup: asyncio.Future[Any] | None = None
        self.ticks = 0
        self.last: dict[str, Any] = {}

    def attach(self, scheduler: Scheduler) -> None:
        from tornado.ioloop import PeriodicCallback

        self.scheduler = scheduler
        for address in scheduler.workers:
            self.add_worker(scheduler, address)
        tick = PeriodicCallback(self.tick, TICK_SECONDS * 1000)
        scheduler.periodic_callbacks[NAME] = tick
        if scheduler.status.name == "running":
            tick.start()

    # ------------------------------------------------------------------------------------ the record

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None and worker not in self.workers:
            self.workers[worker] = WorkerRecord(name=str(ws.name), gpus=float(ws.resources.get("GPU", 0)),
                                                memory_limit=int(ws.memory_limit or 0), nthreads=ws.nthreads,
                                                joined=time.time())

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        if (record := self.workers.get(worker)) is not None and record.left is None:
            record.left = time.time()

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        name = str(key)
        if finish == "forgotten":
            self.pending.discard(name)  # cancelled before it ran (a finished one is no longer pending)
            return
        if name not in self.pending and name not in self.trials:
            self.pending.add(name)
            self.most_known = max(self.most_known, len(self.trials) + len(self.pending))
            if self.first_task is None:
                self.first_task = time.time()
        if start != "processing" or finish not in ("memory", "erred"):
            return
        compute = [s for s in kwargs.get("startstops") or () if s.get("action") == "compute"]
        ws = self.scheduler.workers.get(kwargs.get("worker")) if self.scheduler else None
        ts = self.scheduler.tasks.get(key) if self.scheduler else None
        if not compute or ws is None:
            return
        record = TrialRecord(
            key=name, worker=str(ws.name), start=float(compute[0]["start"]), stop=float(compute[-1]["stop"]),
            failed=finish == "erred" and not _interrupted(ts), interrupted=finish == "erred" and _interrupted(ts),
            asked_gpu=bool(ts is not None and (ts.resource_restrictions or {}).get("GPU")))
        if (msg := self.sampled.pop(name, None)) is not None:
            record.sampled(msg)
        self.trials.add(record)  # computed again (a lost worker's result): counted once
        self.pending.discard(name)

    def log_event(self, topic: str, msg: Any) -> None:
        if topic != TOPIC or not isinstance(msg, dict):
            return
        if "key" in msg:
            if (record := self.trials.get(key := str(msg["key"]))) is None:
                self.sampled[key] = msg  # its record comes with the scheduler's transition
                if len(self.sampled) > RECENT:
                    self.sampled.popitem(last=False)
            else:
                self.trials.update(record, msg)
        elif msg.get("gpus") and (record := self.workers.get(msg.get("worker"))) is not None:
            record.gpu_ids = [str(g) for g in msg["gpus"]]  # a sampler starting (the scheduler adds "worker")

    # ------------------------------------------------------------------------------------ progress

    def tick(self) -> None:
        self._read_memory()
        self.ticks += 1
        if self.ticks % round(PROGRESS_SECONDS / TICK_SECONDS) == 0:
            trim_span_metadata(self.scheduler)  # else the scheduler keeps a dict per trial submitted
            self.known_flow_runs()
            self._find_flow_run()
            with contextlib.suppress(OSError):
                self.write(self.figures())

    def _read_memory(self) -> None:
        for address, ws in self.scheduler.workers.items():
            if (record := self.workers.get(address)) is not None:
                record.memory_peak = max(record.memory_peak, int(ws.memory.process))

    def figures(self) -> dict[str, Any]:
        """What state.json's "progress" holds: counts, GPUs, times, and where to look."""
        s = self.scheduler
        now = time.time()
        failed, interrupted = self.trials.failed, self.trials.interrupted
        done = len(self.trials) - failed - interrupted
        running = sum(1 for ws in s.workers.values() for ts in ws.executing
                      if ts.state == "processing" and ts.processing_on is ws)
        busy_gpus = sum(float(ws.resources.get("GPU", 0)) for ws in s.workers.values()
                        if ws.resources.get("GPU") and any(ts.state == "processing" for ts in ws.executing))
        total = max(self.most_known, announced_trials(s))  # a big map's rest is still in the flow
        waiting = max(len(self.pending) - running, 0) + max(total - len(self.trials) - len(self.pending), 0)
        eta = None
        if self.first_task is not None and len(self.trials) and (waiting or running):
            rate = len(self.trials) / max(now - self.first_task, 1e-6)
            eta = round((waiting + running) / rate, 1)
        figures: dict[str, Any] = {
            "done": done, "running": running, "failed": failed, "waiting": waiting, "total": total,
            **({"interrupted": interrupted} if interrupted else {}),
            "gpus_busy": _number(busy_gpus), "gpus": _number(sum(float(ws.resources.get("GPU", 0))
                                                                for ws in s.workers.values())),
            "elapsed": round(now - self.started, 1), "eta": eta, "updated": now,
            "dashboard": self._dashboard(),
        }
        if self.metrics is not None and (reported := self.metrics()):
            figures["metrics"] = reported
        if url := self.api.get("PREFECT_API_URL"):
            figures["prefect"] = {"api": url, "ui": self.ui, "flow_runs": [
                {"id": run, "url": prefect_ui_url(url, run, self.api.get("PREFECT_UI_URL"))}
                for run in self.flow_runs]} | managed_server(self.api)
        self.last = figures
        return figures

    def _dashboard(self) -> dict[str, Any] | None:
        server = self.scheduler.services.get("dashboard")
        if server is None:
            return None
        host = self.scheduler.address.split("://")[-1].rsplit(":", 1)[0]
        return {"host": host, "port": int(server.port),
                "bokeh": importlib.util.find_spec("bokeh") is not None}

    def known_flow_runs(self) -> list[str]:
        """COMMAND's flow runs: those its task runners noted, and those its finished trials named."""
        for flow_run in self.noted():
            if flow_run not in self.flow_runs:
                self.flow_runs.append(flow_run)
        return list(self.flow_runs)

    def _find_flow_run(self) -> None:
        """Look up the flow run of one finished trial not looked up yet, in a thread, at most once per tick."""
        url = self.api.get("PREFECT_API_URL")
        if not url or (self.lookup is not None and not self.lookup.done()):
            return
        for key in self.trials.latest(64):  # finished: in the API by now (a waiting one may not be)
            if (m := TASK_RUN_ID.search(key)) and m.group(1) not in self.looked_up:
                self.looked_up.add(m.group(1))
                self.lookup = asyncio.get_running_loop().run_in_executor(None, self._flow_run_of, m.group(1))
                return

    def _flow_run_of(self, task_run_hex: str) -> None:
        client = PrefectApi.from_env(self.api)
        assert client is not None  # looked up only where there is an API
        if self.ui is None:
            self.ui = _serves_ui(client)
        task_run = f"{task_run_hex[:8]}-{task_run_hex[8:12]}-{task_run_hex[12:16]}-{task_run_hex[16:20]}-{task_run_hex[20:]}"
        try:
            flow_run = client.get(f"/task_runs/{task_run}").get("flow_run_id")
        except (OSError, ValueError, AttributeError):
            self.looked_up.discard(task_run_hex)  # not recorded yet, or the API is busy: try again later
            return
        if flow_run and flow_run not in self.flow_runs:
            self.flow_runs.append(flow_run)

    # ------------------------------------------------------------------------------------ the end

    def finish(self, rundir: RunDir) -> list[str]:
        """COMMAND ended: the last progress, then report.json in the run directory; its summary lines."""
        from hpc_garage.cluster.artifacts import attach
        from hpc_garage.cluster.report import build, summary, with_metrics, write

        if (tick := self.scheduler.periodic_callbacks.pop(NAME, None)) is not None:
            tick.stop()
        try:
            try:
                self._read_memory()
                self.known_flow_runs()
                self.write(self.figures())
                report = with_metrics(build(self.record()), rundir)  # and what the trials reported
                write(rundir.report_file, report)
            except Exception as exc:  # noqa: BLE001 - the report must never turn a finished run into a failed one
                return [f"not written ({type(exc).__name__}: {exc})"]
            lines = [*summary(report), f"written to {rundir.report_file} (`hpc-garage report JOB` shows it again)"]
            return [*lines, *attach(report, self.api)]  # the trials' artifacts in Prefect (cluster/artifacts.py)
        finally:
            self.trials.close()  # each of the above walks the trials again

    def record(self, ended: float | None = None) -> dict[str, Any]:
        """Everything the report is computed from, as plain JSON types (cluster/report.py); its trials in the
        order they finished, read afresh each time they are walked (report.Trials)."""
        ended = time.time() if ended is None else ended
        trials = Trials(lambda: (t.as_dict() for t in self.trials.records()), len(self.trials))
        return {"started": self.started, "ended": ended,
                "workers": [{"name": w.name, "gpus": w.gpus, "gpu_ids": w.gpu_ids, "nthreads": w.nthreads,
                             "memory_limit": w.memory_limit, "memory_peak": w.memory_peak, "joined": w.joined,
                             "left": min(w.left, ended) if w.left else ended} for w in self.workers.values()],
                "trials": trials, "flow_runs": self.last.get("prefect", {}).get("flow_runs", []),
                "interrupted": self.interrupted}


def prefect_ui_url(api_url: str, flow_run: str, ui_url: str | None = None) -> str:
    """The Prefect UI page of a flow run: under PREFECT_UI_URL when given (hpc-garage's server sets it), else
    from the API URL (Prefect Cloud's or a server's), as Prefect's own "View at" link."""
    if ui_url:
        return f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run}"
    m = re.match(r"https://api\.prefect\.(cloud|dev)/api/accounts/([^/]+)/workspaces/([^/]+)", api_url)
    if m:
        return f"https://app.prefect.{m.group(1)}/account/{m.group(2)}/workspace/{m.group(3)}/runs/flow-run/{flow_run}"
    return f"{re.sub(r'/api/?$', '', api_url.rstrip('/'))}/runs/flow-run/{flow_run}"


def managed_server(api: Mapping[str, str]) -> dict[str, Any]:
    """{"server": {"machine", "host"}} when the API is hpc-garage's server (`hpc-garage server auth` finds its
    auth string from these); {} for the user's own."""
    try:
        recorded = json.loads(api.get(PREFECT_SERVER_ENV) or "null")
    except ValueError:
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {"server": {key: str(recorded[key]) for key in ("machine", "host") if recorded.get(key)}}


def _serves_ui(api: PrefectApi) -> bool | None:
    """Whether the server behind this API serves Prefect's UI (hpc-garage's own runs without it); None: unknown."""
    base = re.sub(r"/api$", "", api.url)
    if base == api.url:
        return None  # not a server's /api URL (Prefect Cloud): its UI is elsewhere, and always on
    try:
        answer = PrefectApi(base, headers=api.headers, own=api.own).answer("GET", "/")
    except OSError:
        return None
    return answer.status < 400 and "html" in answer.content_type


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value
