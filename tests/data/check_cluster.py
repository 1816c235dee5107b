"""Run by `hpc-garage run` in tests: records what the cluster it was handed looks like, as JSON."""

import gc
import json
import os
import stat
import sys
import time

import dask
from distributed import Client

from hpc_garage.cluster.handoff import handoff_from_env, workers_now

KEYS = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "SLURMD_NODENAME", "PREFECT_API_URL", "HPC_GARAGE_SITE")


def _preloaded() -> tuple[bool, bool]:
    """Prefect's task path imported and its logging set up before any task: forked from the forkserver."""
    from prefect.logging import configuration

    modules = ("hpc_garage.prefect.worker", "prefect.flow_engine", "prefect.main")  # the first task's imports
    return all(m in sys.modules for m in modules), bool(configuration.PROCESS_LOGGING_CONFIG)


def main(out: str) -> None:
    path = os.environ["HPC_GARAGE_SCHEDULER_FILE"]
    h = handoff_from_env()
    refused = None
    if h.tls:
        try:
            Client(h.address, timeout=3).close()
            refused = False
        except Exception:  # TLS handshake or timeout: a client without the job's credentials gets nothing
            refused = True
        gc.collect()  # a failed Client collected while the next holds distributed's LoopRunner lock can hang
    with Client(h.address, security=h.security(), timeout=30) as c:
        envs = c.run(lambda: {k: os.environ.get(k) for k in KEYS})
        hashes = sorted(set(c.run(lambda: hash("hpc-garage")).values()))  # one seed everywhere: Dask needs it
        preloaded = c.run(_preloaded)
        profilers = c.run(lambda dask_worker: [dask.config.get("distributed.worker.profile.enabled"),
                                               "profile" in dask_worker.periodic_callbacks])
        scheduler_has_prefect = False
        for _ in range(300):  # imported in the background while the workers start
            if scheduler_has_prefect := c.run_on_scheduler(lambda: "prefect.flows" in sys.modules):
                break
            time.sleep(0.1)
        workers = {
            w["name"]: {"resources": w["resources"], "nthreads": w["nthreads"], "memory_limit": w["memory_limit"],
                        "env": envs[addr]}
            for addr, w in workers_now(c).items()
        }
    run_dir = os.path.dirname(path)
    record = {
        "address": h.address,
        "job_id": h.job_id,
        "workers": workers,
        "scheduler_file": path,
        "scheduler_file_mode": stat.S_IMODE(os.stat(path).st_mode),
        "run_dir_mode": stat.S_IMODE(os.stat(run_dir).st_mode),
        "tls_modes": [stat.S_IMODE(os.stat(os.path.join(run_dir, "tls", f)).st_mode)
                      for f in sorted(os.listdir(os.path.join(run_dir, "tls")))] if h.tls else [],
        "run_dir_file_modes": {f: stat.S_IMODE(os.stat(os.path.join(run_dir, f)).st_mode)
                               for f in sorted(os.listdir(run_dir)) if os.path.isfile(os.path.join(run_dir, f))},
        "plain_client_refused": refused,
        "string_hashes": hashes,
        "worker_preloaded": sorted(set(preloaded.values())),
        "worker_profilers": sorted(set(map(tuple, profilers.values()))),  # Dask's setting, its sampling callback
        "scheduler_has_prefect": scheduler_has_prefect,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    sys.exit(int(os.environ.get("CHECK_EXIT", "0")))


if __name__ == "__main__":
    main(sys.argv[1])
