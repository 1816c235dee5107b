"""The Prefect task runner for hpc-garage: the job's Dask cluster, `dask-resource:` tags, one Prefect API.

`@flow(task_runner=hpc_garage.task_runner())` runs unchanged in three places:
- under `hpc-garage run` (a batch job, or a login node): $HPC_GARAGE_SCHEDULER_FILE names the cluster `run`
  started; the runner connects to it with the job's TLS credentials;
- anywhere else: the runner starts a local cluster shaped like one node of $HPC_GARAGE_SITE (default
  `local`), TLS on loopback too, since other users of a login node can reach its ports;
- either way the flow and every worker use one Prefect API (`prefect_server.ensure_api`); without that,
  each worker process starts its own temporary server on one SQLite file.

prefect-dask 0.3.7 ignores `dask-resource:` tags, so a "GPU" task may land on a CPU worker. HpcTaskRunner
submits each tagged task under `dask.annotate(resources=...)`, merged with the caller's own annotation.
"""

from __future__ import annotations

import ast
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import dask
from prefect.context import TagsContext
from prefect_dask import DaskTaskRunner

from hpc_garage.errors import UserError
from hpc_garage.handoff import handoff_from_env
from hpc_garage.tags import resources_from_tags

if TYPE_CHECKING:
    from hpc_garage.site import Site

__all__ = ["HpcTaskRunner", "task_runner", "worker_resources"]

SITE_ENV = "HPC_GARAGE_SITE"
LOCAL_CLUSTER = "hpc_garage.launchers.local.LocalSiteCluster"


def task_runner(*, site: str | Site | None = None, **kwargs: Any) -> HpcTaskRunner:
    """The runner for wherever this flow runs; keyword arguments go to DaskTaskRunner.

    It is built when the flow is decorated, before the flow's first API call: the only moment at which
    the flow process can still be pointed at the shared Prefect API.
    """
    from hpc_garage.prefect_server import ensure_api

    if kwargs.get("address") or kwargs.get("cluster") or kwargs.get("cluster_class"):
        use_api(ensure_api())  # the caller chose the cluster; the API is still ours to settle
        return HpcTaskRunner(**kwargs)
    handoff = handoff_from_env()
    if handoff is not None:
        use_api(ensure_api(host=_local_address_towards(handoff.address)))
        client_kwargs = {"security": handoff.security(), **kwargs.pop("client_kwargs", {})}
        return HpcTaskRunner(address=handoff.address, client_kwargs=client_kwargs, **kwargs)
    from distributed.security import Security

    api = ensure_api()
    use_api(api)
    cluster_kwargs = {"site": site or os.environ.get(SITE_ENV) or "local", "env": api,
                      "security": Security.temporary(), **kwargs.pop("cluster_kwargs", {})}
    return HpcTaskRunner(cluster_class=LOCAL_CLUSTER, cluster_kwargs=cluster_kwargs, **kwargs)


class HpcTaskRunner(DaskTaskRunner):
    """DaskTaskRunner that places tasks by their `dask-resource:` tags and refuses unguarded scripts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._placeable: set[frozenset[tuple[str, float]]] = set()  # resource sets some worker offers

    def __enter__(self) -> HpcTaskRunner:
        if not (self.address or self._cluster):
            _refuse_unguarded_flow_call()
        super().__enter__()
        return self

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None,
               dependencies: Any = None) -> Any:  # map() submits through here too
        wanted = task_resources(task)
        if not wanted:
            return super().submit(task, parameters, wait_for, dependencies)
        current = dask.get_annotations().get("resources")
        if callable(current):  # a per-key function from the caller decides on its own
            return super().submit(task, parameters, wait_for, dependencies)
        resources = {**wanted, **(current or {})}  # the caller's `dask.annotate` wins over the task's tags
        self._check_placeable(task, resources)
        with dask.annotate(resources=resources):
            return super().submit(task, parameters, wait_for, dependencies)

    def _check_placeable(self, task: Any, resources: dict[str, float]) -> None:
        """Dask keeps a task no worker can take waiting forever; a typo (`gpu`) must not burn an allocation."""
        key = frozenset(resources.items())
        if key in self._placeable or self.adapt_kwargs:  # an adaptive cluster may grow the worker later
            return
        offered = _offered(self.client)
        if not any(all(have.get(k, 0) >= v for k, v in resources.items()) for have in offered):
            kinds = sorted({_describe(have) for have in offered if have}) or ["nothing"]
            raise UserError(
                f"task {task.name!r} asks for {_describe(resources)} but no worker of this cluster has that "
                f"(workers offer {'; '.join(kinds)}); fix the task's dask-resource: tags or use a site whose "
                f"workers hold it (HPC_GARAGE_SITE, `hpc-garage show`)"
            )
        self._placeable.add(key)


def worker_resources() -> list[dict[str, float]]:
    """Each worker's resources, from inside a running flow: e.g. to drop GPU tags where no worker has one."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    runner = context.task_runner if context else None
    if not isinstance(runner, DaskTaskRunner):
        raise UserError("worker_resources() works inside a flow run whose task runner is hpc_garage.task_runner()")
    return _offered(runner.client)


def _offered(client: Any) -> list[dict[str, float]]:
    return [dict(w.get("resources") or {}) for w in client.scheduler_info(n_workers=-1)["workers"].values()]


def task_resources(task: Any) -> dict[str, float]:
    """Resources from the task's tags and any enclosing `prefect.tags(...)`; zero amounts ask for nothing."""
    tags = set(task.tags) | set(TagsContext.get().current_tags or ())
    try:
        resources = resources_from_tags(tags)
    except UserError as exc:
        raise UserError(f"task {task.name!r}: {exc}") from None
    return {k: v for k, v in resources.items() if v > 0}


def use_api(env: dict[str, str]) -> None:
    """Export the API to this process and its future children; Prefect read its settings at import."""
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    import prefect.context

    os.environ.update(env)
    prefect.context.refresh_global_settings_context()


def _local_address_towards(address: str) -> str:
    """This machine's address on the scheduler's network: where workers can reach a server we start."""
    host = urlsplit(address).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, urlsplit(address).port or 8786))  # UDP: picks a route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return "0.0.0.0"


def _refuse_unguarded_flow_call() -> None:
    """Dask's spawned workers re-import the script: a top-level flow call would run again in each of them
    (seen as "Nanny failed to start"). Refuse before any worker starts, naming the line."""
    if dask.config.get("distributed.worker.multiprocessing-method", "spawn") == "fork":
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return  # python -c, a notebook, an interactive session: nothing gets re-imported
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return  # the flow was not called from the script's top level (a thread, a test runner)
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError):
        return
    if any(_is_main_guard(node) and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
           for node in tree.body):
        return
    raise UserError(
        f"{path}, line {line}: the flow is called at the top level of the script; the Dask worker processes "
        f"re-import the script and would run the flow again. Put the call under `if __name__ == \"__main__\":`"
    )


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(test := node.test, ast.Compare) or len(test.ops) != 1:
        return False
    sides = [test.left, test.comparators[0]]
    return (isinstance(test.ops[0], ast.Eq) and any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _describe(resources: dict[str, float]) -> str:
    from hpc_garage.units import format_bytes

    return ", ".join(f"{k}={format_bytes(v).replace(' ', '')}" if k == "MEMORY" else f"{k}={v:g}"
                     for k, v in sorted(resources.items()))
