"""What a run leaves on its trials in Prefect: table artifacts on their task runs and flow runs, at its end.

`attach(report, api)` is called once, by `progress.RunProgress.finish`, with the run's report.json
(cluster/report.py): `attach_gpu_figures` gives each Prefect trial whose worker read its GPUs one table
(ARTIFACT_KEY) on its task run and flow run, `attach_trial_metrics` each trial that reported (`trial.report`)
its last and best values on its task run (TRIAL_METRICS_KEY) and the sweep's counts on its flow run
(SWEEP_METRICS_KEY). A trial's Dask key names its task run (`<task name>-<task run id hex>`, prefect/fast.py);
one `/task_runs/filter` per 200 trials finds their flow runs. Everything goes through hpc-garage's plain HTTP
client (hpc_garage/prefect_api.py: this layer does not import Prefect), within ATTACH_SECONDS in all and
ATTACH_CALL_SECONDS a call; it is bookkeeping, so it never fails the run: what is not attached is counted in
the line it returns, and stays in report.json.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from hpc_garage.cluster.report import GPU_FIGURES, TASK_RUN_ID
from hpc_garage.cluster.trial_metrics import lines as metrics_lines
from hpc_garage.core.units import format_bytes
from hpc_garage.prefect_api import PrefectApi

__all__ = ["ARTIFACT_KEY", "ATTACH_CALL_SECONDS", "ATTACH_SECONDS", "SWEEP_METRICS_KEY", "TRIAL_METRICS_KEY",
           "attach", "attach_gpu_figures", "attach_trial_metrics"]

ARTIFACT_KEY = "hpc-garage-trial-gpu"  # Prefect's artifact keys: lowercase letters, digits and dashes
TRIAL_METRICS_KEY = "hpc-garage-trial-metrics"  # a reporting trial's last and best values, on its task run
SWEEP_METRICS_KEY = "hpc-garage-sweep-metrics"  # the run's trials: done, pruned, best, saved; on its flow run
ATTACH_SECONDS = 10.0  # all the artifacts of a run's end together; what is left unattached is counted
ATTACH_CALL_SECONDS = 3.0  # one call to the API
ATTACH_THREADS = 4


def attach(report: dict[str, Any], api: Mapping[str, str]) -> list[str]:
    """Both kinds of artifacts within ATTACH_SECONDS together; the lines that say what was attached (none
    where there was nothing to attach or no API). Never raises: bookkeeping in Prefect never fails the run."""
    started = time.monotonic()
    try:
        attached = attach_gpu_figures(report, api)
    except Exception as exc:  # noqa: BLE001 - bookkeeping in Prefect: never fails the run
        attached = f"GPU figures not attached to Prefect's task runs ({type(exc).__name__}: {exc})"
    left = max(ATTACH_SECONDS - (time.monotonic() - started), 0.1)  # spent: the lookup says it did not answer
    try:
        reported = attach_trial_metrics(report, api, budget=left)
    except Exception as exc:  # noqa: BLE001 - bookkeeping in Prefect: never fails the run
        reported = f"trial metrics not attached to Prefect's task runs ({type(exc).__name__}: {exc})"
    return [line for line in (attached, reported) if line]


def attach_gpu_figures(report: dict[str, Any], api: Mapping[str, str], *, budget: float = ATTACH_SECONDS,
                       call_timeout: float = ATTACH_CALL_SECONDS) -> str | None:
    """Each Prefect trial of the report with GPU figures (its worker read its GPUs) gets one table artifact on
    its task run and flow run; the line that says how many, or None where no trial has figures or there is no
    API (then nothing is asked: a CPU-only sweep costs no call). At most `budget` seconds in all: one
    `/task_runs/filter` per 200 trials finds their flow runs (an API that does not answer stops here), then
    the artifacts, a few at a time; what the budget leaves is counted, not retried."""
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
        memory = format_bytes(trial.get("gpu_memory_peak", 0), tenths=True)
        description = (f"GPU figures of this trial as its worker {trial['worker']} sampled them on GPU "
                       f"{row['gpus']} (hpc-garage): utilisation mean {trial['gpu_util_mean']:.0f} %, peak "
                       f"{trial.get('gpu_util_peak', 0):.0f} %, device memory peak {memory}, over "
                       f"{trial['duration_s']:.2f} s")
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
             "description": "What the trials of this run reported (hpc-garage): " + "; ".join(metrics_lines(metrics))}
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
