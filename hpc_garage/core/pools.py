"""Pools of worker jobs (launcher: jobqueue): the shape of one job, what its workers offer, how `show` says it.

Pure: no I/O, no Dask. A pool is one full Site (`Site.pool_sites()`), so one worker job's workers are simply
`layout(pool site, the allocation one job asks for)`; the worker job runs the same layout on the allocation
it got. How many jobs each pool keeps, and where an unplaced task counts, is the launcher's scaling policy
(`hpc_garage.launchers.jobqueue.scaling`), built on the shapes and `fits` here.

Placement across pools rests on Dask resources alone. Tagged tasks go wherever a worker holds what they ask
(`GPU=1` → GPU workers, `MEMORY=200e9` → workers that big). Tasks with no resource tags get one marker
resource, `UNTAGGED=1`, which only the workers of pools that take untagged tasks advertise: so a plain task
never takes a GPU worker's slot unless the site allows it. The marker is only used when some pool refuses
untagged tasks; a site with one pool places tasks exactly as Dask always does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from hpc_garage.core.allocation import Allocation
from hpc_garage.core.request import Request
from hpc_garage.core.layout import Layout, WorkerSpec, describe, layout
from hpc_garage.core.site import Site
from hpc_garage.core.units import format_bytes, format_walltime

UNTAGGED = "UNTAGGED"  # the marker resource of tasks without resource tags
UNTAGGED_SUPPLY = 1_000_000  # what a worker that takes untagged tasks advertises: threads, not this, limit them


# ------------------------------------------------------------------------------------------ one job's shape


@dataclass(frozen=True)
class JobShape:
    """One worker job of a pool: what it asks the batch system for and the workers it starts."""

    pool: str
    site: Site  # the pool's full site
    layout: Layout  # the workers of one job (names n0-…; the job names them `<job>-<k>`)
    untagged: bool  # this pool's workers take tasks without resource tags
    marker: bool  # the site uses the UNTAGGED marker (some pool refuses untagged tasks)

    @property
    def node(self) -> Any:
        return self.layout.allocation.nodes[0]

    @property
    def cores(self) -> int:
        return int(self.node.cores)

    @property
    def memory(self) -> int:
        return int(self.node.memory)

    @property
    def gpus(self) -> int:
        return len(self.node.gpus)

    @property
    def workers_per_job(self) -> int:
        return len(self.layout.workers)

    @cached_property
    def worker_resources(self) -> list[dict[str, float]]:
        """What each worker of a job advertises, marker included (read per queued task by the scaling step,
        every second: computed once)."""
        return [advertised(w.resources, untagged=self.untagged, marker=self.marker) for w in self.layout.workers]

    @property
    def walltime(self) -> int:
        return int(self.layout.allocation.walltime or self.site.walltime)


def job_shapes(site: Site) -> dict[str, JobShape]:
    """Every pool's job shape, in the site's order."""
    untagged = site.untagged_pools()
    sites = site.pool_sites()
    marker = len(untagged) < len(sites)
    return {name: job_shape(name, s, untagged=name in untagged, marker=marker) for name, s in sites.items()}


def job_shape(pool: str, site: Site, *, untagged: bool = True, marker: bool = False) -> JobShape:
    """One job = one node, or one GPU slice of a node with the same share of its cores and memory."""
    jq = site.jobqueue
    allocation = Allocation.from_request(site, Request(
        nodes=1, gpus_per_node=jq.gpus_per_job, cores_per_node=jq.cores_per_job,
        memory=jq.memory_per_job, walltime=site.walltime,
    ))
    return JobShape(pool=pool, site=site, layout=layout(site, allocation), untagged=untagged, marker=marker)


def pool_offers(shapes: Mapping[str, JobShape]) -> list[dict[str, float]]:
    """The resources of every kind of worker the pools can start, whether or not one runs now: a task
    asking for one of these is placeable, it may only wait for a job (adaptive pools start at zero)."""
    offers: list[dict[str, float]] = []
    for shape in shapes.values():
        for resources in shape.worker_resources:
            if resources not in offers:
                offers.append(resources)
    return offers


def worker_names(job_name: str, count: int) -> list[str]:
    """The names dask-jobqueue's SpecCluster expects for a job's workers: `<job>-<k>`, or `<job>` alone."""
    return [job_name] if count == 1 else [f"{job_name}-{k}" for k in range(count)]


def advertised(resources: Mapping[str, float], *, untagged: bool, marker: bool) -> dict[str, float]:
    """A worker's resources, with the marker where its pool takes untagged tasks and the site uses it."""
    return {**resources, UNTAGGED: UNTAGGED_SUPPLY} if marker and untagged else dict(resources)


def untagged_restrictions(resources: Mapping[str, float] | None, marker: str | None) -> dict[str, float]:
    """The placement rule: what a task asks of a worker. Tagged tasks keep their tags; a task with none asks
    for the marker (when the site uses one), so only workers of pools that take untagged tasks run it."""
    wanted = {k: v for k, v in (resources or {}).items() if v > 0}
    return wanted if wanted or not marker else {marker: 1}


# ------------------------------------------------------------------------------------------------ lifetime


RUN_END_MARGIN = 10  # seconds before the run's end (its driver job's) by which worker jobs have retired


def lifetime(site: Site, remaining: float | None = None, run_remaining: float | None = None,
             cut: bool = False) -> tuple[int, int]:
    """(lifetime, stagger) in seconds, so every worker has retired `lifetime_margin` before the batch system
    ends its job, and RUN_END_MARGIN before the run that uses it ends: workers retire within lifetime ± stagger.

    `remaining` is the job's real time left (from its end time, read inside the job) when known;
    `run_remaining` the run's (its driver job's end, or --time), when it has one. A job whose walltime was
    `cut` to the run's end keeps RUN_END_MARGIN to its own end too, unstaggered (the site's margin and
    stagger are shares of its walltime).
    """
    budget = site.walltime if remaining is None else min(site.walltime, int(remaining))
    stagger = 0 if cut else site.lifetime_stagger
    life = budget - (min(site.lifetime_margin, RUN_END_MARGIN) if cut else site.lifetime_margin) - stagger
    if run_remaining is not None:
        life = min(life, int(run_remaining) - RUN_END_MARGIN - stagger)
    return max(1, life), stagger


# ----------------------------------------------------------------------------------------- where tasks go


EPSILON = 1e-9  # resource amounts are floats: 0.1 + 0.2 must fit in 0.3


def fits(wanted: Mapping[str, float], offered: Mapping[str, float], used: Mapping[str, float] | None = None) -> bool:
    """Whether `wanted` fits in what is offered and not used (the scaling's pool choice; placement.py's hand-off)."""
    used = used or {}
    return all(used.get(r, 0.0) + amount <= offered.get(r, 0.0) + EPSILON for r, amount in wanted.items())


# ------------------------------------------------------------------------------------------------- showing


def describe_site(site: Site) -> list[str]:
    """`show` for a jobqueue site: per pool, one worker job's resource math and how the pool scales."""
    shapes = job_shapes(site)
    lines = [f"site {site.name} ({site.scheduler}, jobqueue launcher): {len(shapes)} pool(s) of worker jobs, "
             f"at most {site.jobqueue.max_jobs_in_queue} worker jobs queued or running"]
    if site.jobqueue.driver == "job":
        lines.append(f"submit: a driver job ({site.jobqueue.driver_cores} core(s), "
                     f"{format_bytes(site.jobqueue.driver_memory)}) runs the scheduler and the script")
    else:
        lines.append("submit: the driver (scheduler and script) runs here, on the login node")
    for shape in shapes.values():
        jq = shape.site.jobqueue
        fewest, most = jq.bounds
        scaling = f"adaptive {fewest}..{most} jobs (idle {jq.idle_timeout} s → cancelled)" if jq.adaptive \
            else f"{fewest} job(s)"
        life, stagger = lifetime(shape.site)
        takes = "takes untagged tasks" if shape.untagged else "tagged tasks only"
        lines.append(f"pool {shape.pool}: queue {shape.site.queue or '(default)'}, {scaling}, {takes}, "
                     f"walltime {format_walltime(shape.walltime)}, workers retire after "
                     f"{format_walltime(life)} ± {stagger} s")
        body = describe(replace(shape.layout, workers=_resourced(shape)))[1:]  # the site line is said above
        lines += ["  " + line.replace("request: 1 node(s)", "one worker job: 1 node") for line in body
                  if not line.startswith("total:")]
    return lines


def show_pools(site: Site, *, as_json: bool = False, **request: Any) -> str:
    """`hpc-garage show` for a jobqueue site. Request flags do not apply: the site's jobqueue: shapes the jobs."""
    import json

    refuse_request(site, request)
    return json.dumps(to_dict(site), indent=2) if as_json else "\n".join(describe_site(site))


def refuse_request(site: Site, request: Mapping[str, Any]) -> None:
    """Jobqueue sites take their worker jobs' shape from the site; a request flag would be silently ignored."""
    from hpc_garage.core.errors import UserError

    flags = {"nodes": "--nodes", "gpus_per_node": "--gpus-per-node", "cores_per_node": "--cores-per-node",
             "cores_per_worker": "-c/--cpus-per-task", "mem": "--mem", "memory": "--mem", "gpu_type": "a GPU type"}
    asked = [flag for key, flag in flags.items() if request.get(key) is not None]
    if asked:
        flag = asked[0]
        raise UserError(f"{flag}: site {site.name} runs worker jobs shaped by its jobqueue: section (gpus_per_job, "
                        f"cores_per_job, memory_per_job, jobs); drop the flag, or edit the site "
                        f"(`hpc-garage show --site {site.name}` shows the jobs)")


def to_dict(site: Site) -> dict[str, Any]:
    """`show --json` for a jobqueue site."""
    return {
        "site": site.model_dump(mode="json") | {"path": str(site.path) if site.path else None},
        "pools": {
            name: {
                "queue": shape.site.queue,
                "scaling": dict(zip(("minimum_jobs", "maximum_jobs"), shape.site.jobqueue.bounds))
                | {"adaptive": shape.site.jobqueue.adaptive},
                "untagged": shape.untagged,
                "job": {"cores": shape.cores, "memory": shape.memory, "gpus": shape.gpus,
                        "walltime": shape.walltime},
                "lifetime": dict(zip(("lifetime", "stagger"), lifetime(shape.site))),
                "workers": [w.to_dict() for w in _resourced(shape)],
                "leftovers": shape.layout.leftovers,
            }
            for name, shape in job_shapes(site).items()
        },
    }


def _resourced(shape: JobShape) -> list[WorkerSpec]:
    return [replace(w, resources=r) for w, r in zip(shape.layout.workers, shape.worker_resources)]
