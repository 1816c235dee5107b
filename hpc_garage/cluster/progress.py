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
  (`<task name>-<task run id hex>`, prefect/fast.py) through the API's `/task_runs/{id}`.
At the end, `finish()` turns the record into the efficiency report (cluster/report.py): each trial's span as
its worker's sampler timed it (Dask's startstops where no sampler spoke); then `attach_gpu_figures` gives
each Prefect trial whose worker read its GPUs one table artifact (key ARTIFACT_KEY) on its task run and flow
run, through the same API with hpc-garage's plain HTTP client (hpc_garage/prefect_api.py: this layer does not
import Prefect), and `attach_trial_metrics` each trial that reported (`trial.report`) its last and best values
on its task run and the sweep's counts on its flow run, all within ATTACH_SECONDS. What the trials reported
(the run directory's trials.json, cluster/trial_metrics.py) is in the progress too ("metrics": reporting,
pruned, the best trial), read only when the file changed, and in the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from hpc_garage.cluster.report import TASK_RUN_ID
from hpc_garage.cluster.trial_metrics import Watch
from hpc_garage.launchers.gpu_sampler import NAME as SAMPLER_NAME, TOPIC, TrialSampler
from hpc_garage.prefect_api import PrefectApi
from hpc_garage.variables import PREFECT_SERVER_ENV

if TYPE_CHECKING:
    from distributed import Scheduler

    from hpc_garage.rundir import RunDir

__all__ = ["ARTIFACT_KEY", "NAME", "PROGRESS_SECONDS", "SWEEP_METRICS_KEY", "TRIAL_METRICS_KEY", "RunProgress",
           "attach_gpu_figures", "attach_trial_metrics", "install", "prefect_ui_url"]

NAME = "hpc-garage-progress"
PROGRESS_SECONDS = 2.0
TICK_SECONDS = 1.0  # memory peaks are read this often (the workers' heartbeats update them)
ARTIFACT_KEY = "hpc-garage-trial-gpu"  # Prefect's artifact keys: lowercase letters, digits and dashes
TRIAL_METRICS_KEY = "hpc-garage-trial-metrics"  # a reporting trial's last and best values, on its task run
SWEEP_METRICS_KEY = "hpc-garage-sweep-metrics"  # the run's trials: done, pruned, best, saved; on its flow run
ATTACH_SECONDS = 10.0  # all the artifacts of a run's end together; what is left unattached is counted
ATTACH_CALL_SECONDS = 3.0  # one call to the API
ATTACH_THREADS = 4


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


@dataclass
class TrialRecord:
    key: str
    worker: str
    start: float
    stop: float
    failed: bool
    asked_gpu: bool
    interrupted: bool = False  # it raised hpc_garage.trial.Interrupted: saved, not done (not failed)


def _interrupted(ts: Any) -> bool:
    """Whether an erred task raised hpc_garage.trial.Interrupted (Dask keeps the exception's repr)."""
    return str(getattr(ts, "exception_text", "") or "").startswith("Interrupted(")


async def install(scheduler: Scheduler, write: Callable[[dict[str, Any]], None], *, vendor: str = "nvidia",
                  api: Mapping[str, str] | None = None, noted: Callable[[], list[str]] | None = None,
                  metrics: Path | None = None) -> RunProgress:
    """Progress on this scheduler, and the GPU sampler on every worker that joins it (before they start).
    `noted`: the flow runs COMMAND's task runners noted (cluster/handoff.py), known before any trial ends;
    `metrics`: the run directory's trials.json (RunDir.metrics_summary), what the trials reported."""
    from distributed.protocol.pickle import dumps

    plugin = RunProgress(write, api=api, noted=noted, metrics=metrics)
    scheduler.add_plugin(plugin, name=NAME)
    plugin.attach(scheduler)
    await scheduler.register_worker_plugin(None, dumps(TrialSampler(vendor)), name=SAMPLER_NAME, idempotent=True)
    return plugin


class RunProgress(SchedulerPlugin):
    """See the module docstring. One instance per scheduler."""

    name = NAME

    def __init__(self, write: Callable[[dict[str, Any]], None], *, api: Mapping[str, str] | None = None,
                 noted: Callable[[], list[str]] | None = None, metrics: Path | None = None) -> None:
        self.write = write
        self.metrics = Watch(metrics) if metrics is not None else None  # trials.json, read when it changed
        self.api = dict(api or {})
        self.noted = noted or list
        self.scheduler: Any = None
        self.started = time.time()
        self.first_task: float | None = None
        self.known: dict[str, None] = {}  # ordered: the newest last
        self.most_known = 0  # the most trials known at once: a COMMAND stopped mid-sweep forgets the rest
        self.trials: dict[str, TrialRecord] = {}
        self.sampled: dict[str, dict[str, Any]] = {}  # key → the worker's sampler event
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
            if name not in self.trials:
                self.known.pop(name, None)  # cancelled before it ran
            return
        if name not in self.known:
            self.known[name] = None
            self.most_known = max(self.most_known, len(self.known))
            if self.first_task is None:
                self.first_task = time.time()
        if start != "processing" or finish not in ("memory", "erred"):
            return
        compute = [s for s in kwargs.get("startstops") or () if s.get("action") == "compute"]
        ws = self.scheduler.workers.get(kwargs.get("worker")) if self.scheduler else None
        ts = self.scheduler.tasks.get(key) if self.scheduler else None
        if not compute or ws is None:
            return
        self.trials[name] = TrialRecord(
            key=name, worker=str(ws.name), start=float(compute[0]["start"]), stop=float(compute[-1]["stop"]),
            failed=finish == "erred" and not _interrupted(ts), interrupted=finish == "erred" and _interrupted(ts),
            asked_gpu=bool(ts is not None and (ts.resource_restrictions or {}).get("GPU")))

    def log_event(self, topic: str, msg: Any) -> None:
        if topic != TOPIC or not isinstance(msg, dict):
            return
        if "key" in msg:
            self.sampled[str(msg["key"])] = msg
        elif msg.get("gpus") and (record := self.workers.get(msg.get("worker"))) is not None:
            record.gpu_ids = [str(g) for g in msg["gpus"]]  # a sampler starting (the scheduler adds "worker")

    # ------------------------------------------------------------------------------------ progress

    def tick(self) -> None:
        self._read_memory()
        self.ticks += 1
        if self.ticks % round(PROGRESS_SECONDS / TICK_SECONDS) == 0:
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
        failed = sum(1 for t in self.trials.values() if t.failed or self.sampled.get(t.key, {}).get("failed"))
        interrupted = sum(1 for t in self.trials.values() if t.interrupted)
        done = len(self.trials) - failed - interrupted
        running = sum(1 for ws in s.workers.values() for ts in ws.executing
                      if ts.state == "processing" and ts.processing_on is ws)
        busy_gpus = sum(float(ws.resources.get("GPU", 0)) for ws in s.workers.values()
                        if ws.resources.get("GPU") and any(ts.state == "processing" for ts in ws.executing))
        waiting = max(len(self.known) - len(self.trials) - running, 0)
        eta = None
        if self.first_task is not None and len(self.trials) and (waiting or running):
            rate = len(self.trials) / max(now - self.first_task, 1e-6)
            eta = round((waiting + running) / rate, 1)
        figures: dict[str, Any] = {
            "done": done, "running": running, "failed": failed, "waiting": waiting, "total": self.most_known,
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
        for key in reversed(list(self.trials)[-64:]):  # finished: in the API by now (a waiting one may not be)
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
        from hpc_garage.cluster.report import build, summary, with_metrics
        from hpc_garage.files import write_json

        if (tick := self.scheduler.periodic_callbacks.pop(NAME, None)) is not None:
            tick.stop()
        try:
            self._read_memory()
            self.known_flow_runs()
            self.write(self.figures())
            report = with_metrics(build(self.record()), rundir)  # and what the trials reported
            write_json(rundir.report_file, report)
        except Exception as exc:  # noqa: BLE001 - the report must never turn a finished run into a failed one
            return [f"not written ({type(exc).__name__}: {exc})"]
        lines = [*summary(report), f"written to {rundir.report_file} (`hpc-garage report JOB` shows it again)"]
        started = time.monotonic()  # both kinds of artifacts within ATTACH_SECONDS
        try:
            attached = attach_gpu_figures(report, self.api)
        except Exception as exc:  # noqa: BLE001 - bookkeeping in Prefect: never fails the run
            attached = f"GPU figures not attached to Prefect's task runs ({type(exc).__name__}: {exc})"
        left = max(ATTACH_SECONDS - (time.monotonic() - started), 0.1)  # spent: the lookup says it did not answer
        try:
            reported = attach_trial_metrics(report, self.api, budget=left)
        except Exception as exc:  # noqa: BLE001 - bookkeeping in Prefect: never fails the run
            reported = f"trial metrics not attached to Prefect's task runs ({type(exc).__name__}: {exc})"
        return [*lines, *(line for line in (attached, reported) if line)]

    def record(self, ended: float | None = None) -> dict[str, Any]:
        """Everything the report is computed from, as plain JSON types (cluster/report.py)."""
        ended = time.time() if ended is None else ended
        trials = []
        for t in sorted(self.trials.values(), key=lambda t: t.start):
            sampled = self.sampled.get(t.key, {})
            start, stop = (sampled["start"], sampled["stop"]) if "stop" in sampled else (t.start, t.stop)
            trial = {"key": t.key, "worker": t.worker, "start": start, "stop": stop,
                     "failed": t.failed or bool(sampled.get("failed")), "asked_gpu": t.asked_gpu,
                     **({"interrupted": True} if t.interrupted else {})}
            trial |= {k: v for k, v in sampled.items() if k.startswith("gpu")}
            trials.append(trial)
        return {"started": self.started, "ended": ended,
                "workers": [{"name": w.name, "gpus": w.gpus, "gpu_ids": w.gpu_ids, "nthreads": w.nthreads,
                             "memory_limit": w.memory_limit, "memory_peak": w.memory_peak, "joined": w.joined,
                             "left": min(w.left, ended) if w.left else ended} for w in self.workers.values()],
                "trials": trials, "flow_runs": self.last.get("prefect", {}).get("flow_runs", []),
                "interrupted": self.interrupted}


def attach_gpu_figures(report: dict[str, Any], api: Mapping[str, str], *, budget: float = ATTACH_SECONDS,
                       call_timeout: float = ATTACH_CALL_SECONDS) -> str | None:
    """Each Prefect trial of the report with GPU figures (its worker read its GPUs) gets one table artifact on
    its task run and flow run; the line that says how many, or None where no trial has figures or there is no
    API (then nothing is asked: a CPU-only sweep costs no call). At most `budget` seconds in all: one
    `/task_runs/filter` per 200 trials finds their flow runs (an API that does not answer stops here), then
    the artifacts, a few at a time; what the budget leaves is counted, not retried."""
    from hpc_garage.cluster.report import GPU_FIGURES, _size

    url = api.get("PREFECT_API_URL")
    trials = {str(uuid.UUID(hex=m.group(1))): t for t in report.get("trials", [])
              if "gpu_util_mean" in t and t.get("gpus") and (m := TASK_RUN_ID.search(t["key"]))}
    if not url or not trials:
        return None
    client = PrefectApi.from_env(api, timeout=call_timeout, budget=budget)
    assert client is not None and client.deadline is not None  # an API (checked above), and a budget
    ids = list(trials)
    try:
        flow_runs = _flow_runs_of(client, ids)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return (f"GPU figures of {len(trials)} trials not attached to Prefect's task runs: the API at {url} did "
                f"not answer ({exc}); they are in report.json")

    def artifact(task_run: str) -> dict[str, Any]:
        trial = trials[task_run]
        row = {"worker": trial["worker"], "gpus": ",".join(map(str, trial["gpus"])), "duration_s": trial["duration_s"],
               **{k: trial[k] for k in GPU_FIGURES if k in trial}}
        description = (f"GPU figures of this trial as its worker {trial['worker']} sampled them on GPU "
                       f"{row['gpus']} (hpc-garage): utilisation mean {trial['gpu_util_mean']:.0f} %, peak "
                       f"{trial.get('gpu_util_peak', 0):.0f} %, device memory peak "
                       f"{_size(trial.get('gpu_memory_peak', 0))}, over {trial['duration_s']:.2f} s")
        return {"key": ARTIFACT_KEY, "type": "table", "description": description, "data": json.dumps([row]),
                "task_run_id": task_run, "flow_run_id": flow_runs[task_run] or None}

    known = [task_run for task_run in ids if task_run in flow_runs]  # in the API: a plain Dask key is not
    attached = _post_all(client, [artifact(task_run) for task_run in known], ARTIFACT_KEY)
    line = f"GPU figures attached to {attached} Prefect task runs as artifacts (key {ARTIFACT_KEY})"
    return _with_missed(line, len(trials) - len(known), "", len(known) - attached, "", budget)


def attach_trial_metrics(report: dict[str, Any], api: Mapping[str, str], *, budget: float = ATTACH_SECONDS,
                         call_timeout: float = ATTACH_CALL_SECONDS) -> str | None:
    """What the trials reported (report.json's "metrics", cluster/trial_metrics.py) as table artifacts: on
    each reporting Prefect trial's task run (key TRIAL_METRICS_KEY: last and best of each metric, its state and
    steps) and on their flow runs (key SWEEP_METRICS_KEY: done, pruned, the best trial, what pruning saved); the
    line that says how many, or None where no trial reported or there is no API (then nothing is asked). As
    `attach_gpu_figures`: one `/task_runs/filter` per 200 trials, then the artifacts, within `budget` in all."""
    from hpc_garage.cluster.trial_metrics import lines

    metrics = report.get("metrics") or {}
    url = api.get("PREFECT_API_URL")
    trials = {str(uuid.UUID(hex=t["run"])): t for t in metrics.get("trials", [])
              if isinstance(t.get("run"), str) and re.fullmatch(r"[0-9a-f]{32}", t["run"])}
    if not url or not trials:
        return None
    client = PrefectApi.from_env(api, timeout=call_timeout, budget=budget)
    assert client is not None and client.deadline is not None  # an API (checked above), and a budget
    try:
        flow_runs = _flow_runs_of(client, list(trials))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return (f"trial metrics of {len(trials)} trials not attached to Prefect's task runs: the API at {url} did "
                f"not answer ({exc}); they are in report.json")

    def trial_artifact(task_run: str) -> dict[str, Any]:
        t = trials[task_run]
        rows = [{"metric": name, "last": t["last"].get(name), "best": t["best"].get(name), "state": t["state"],
                 "reports": t.get("reports"), "last_step": t.get("last_step")}
                for name in dict.fromkeys([*t["best"], *t["last"]])]
        description = (f"What trial {t['trial']} reported (hpc-garage, `trial.report`): {t.get('reports')} reports, "
                       f"the last at step {t.get('last_step')}; {t['state']}"
                       + (" (stopped early by the pruner)" if t["state"] == "pruned" else ""))
        return {"key": TRIAL_METRICS_KEY, "type": "table", "description": description, "data": json.dumps(rows),
                "task_run_id": task_run, "flow_run_id": flow_runs[task_run] or None}

    best, saved = metrics.get("best") or {}, metrics.get("saved") or {}
    sweep_row = {"reporting": metrics.get("reporting"), "done": metrics.get("done"), "pruned": metrics.get("pruned"),
                 "did_not_end": metrics.get("running"), "pruner": metrics.get("pruner"), "metric": best.get("metric"),
                 "best_trial": best.get("trial"), "best_task": best.get("task"), "best_value": best.get("value"),
                 "best_step": best.get("step"), f"{saved.get('unit', 'GPU-s')} saved (estimate)": saved.get("seconds")}
    sweep = {"key": SWEEP_METRICS_KEY, "type": "table", "data": json.dumps([sweep_row]),
             "description": "What the trials of this run reported (hpc-garage): " + "; ".join(lines(metrics))}
    known = [task_run for task_run in trials if task_run in flow_runs]  # in the API: a plain Dask key is not
    runs = list(dict.fromkeys(flow_runs[task_run] for task_run in known if flow_runs[task_run]))
    bodies = [trial_artifact(task_run) for task_run in known] + [sweep | {"flow_run_id": run} for run in runs]
    attached = _post_all(client, bodies, TRIAL_METRICS_KEY)
    line = (f"trial metrics attached to {min(attached, len(known))} Prefect task runs as artifacts (key "
            f"{TRIAL_METRICS_KEY}), the sweep's to their flow run{'s' if len(runs) != 1 else ''} "
            f"(key {SWEEP_METRICS_KEY})")
    return _with_missed(line, len(trials) - len(known), " trials", len(bodies) - attached, " artifacts", budget)


def _with_missed(line: str, absent: int, trials: str, unattached: int, artifacts: str, budget: float) -> str:
    """`line`, then what the API did not know and what was not attached within the budget, where any."""
    missed = [f"{absent}{trials} not in the API"] * (absent > 0)
    missed += [f"{unattached}{artifacts} not attached within {budget:g} s or refused"] * (unattached > 0)
    return f"{line}; {', '.join(missed)}" if missed else line


def _flow_runs_of(client: PrefectApi, task_runs: list[str]) -> dict[str, str]:
    """The flow run of each task run the API knows ("" where it has none), 200 a call."""
    flow_runs: dict[str, str] = {}
    for at in range(0, len(task_runs), 200):
        for run in client.post("/task_runs/filter", {"task_runs": {"id": {"any_": task_runs[at:at + 200]}},
                                                     "limit": 200}):
            flow_runs[str(run["id"])] = str(run.get("flow_run_id") or "")
    return flow_runs


def _post_all(client: PrefectApi, artifacts: list[dict[str, Any]], name: str) -> int:
    """POST each artifact, a few at a time, until the client's deadline; how many the API took."""
    assert client.deadline is not None
    pool = ThreadPoolExecutor(ATTACH_THREADS, thread_name_prefix=name)
    futures = [pool.submit(client.post, "/artifacts/", body) for body in artifacts]
    wait(futures, timeout=max(client.deadline - time.monotonic(), 0))
    pool.shutdown(wait=False, cancel_futures=True)
    return sum(1 for f in futures if f.done() and not f.cancelled() and f.exception() is None)


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
