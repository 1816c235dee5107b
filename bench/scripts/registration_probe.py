"""The scaling benchmark's COMMAND under `hpc-garage run`: watch the run process (its parent, which hosts the
scheduler) while the workers register, and write what it saw once the scheduler file is published.

    hpc-garage run --site SITE -- python registration_probe.py OUT.json

No Prefect, no Dask import here (this process must cost the 2 shared cores nothing worth speaking of). Every
20 ms it reads: the run process's main-thread CPU (/proc/PPID/task/PPID/stat: the scheduler's event loop,
where registrations are handled one at a time; `run`'s background import thread is left out), its whole CPU,
and the registered-worker count `run` writes to state.json as it changes. Registration is complete when
$HPC_GARAGE_SCHEDULER_FILE appears (its mtime).
"""

import json
import os
import sys
import time


def cpu(path: str) -> float:
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    out = sys.argv[1]
    parent = os.getppid()
    scheduler_file = os.environ["HPC_GARAGE_SCHEDULER_FILE"]
    state = os.path.join(os.environ["HPC_GARAGE_RUN_DIR"], "state.json")
    samples = []  # [time, main-thread CPU s, process CPU s, workers registered]
    while not os.path.exists(scheduler_file):
        workers = 0
        try:
            workers = int(json.load(open(state)).get("workers", 0))
        except (OSError, ValueError):
            pass
        samples.append([time.time(), cpu(f"/proc/{parent}/task/{parent}/stat"), cpu(f"/proc/{parent}/stat"), workers])
        time.sleep(0.02)
    registered = os.stat(scheduler_file).st_mtime
    final = [time.time(), cpu(f"/proc/{parent}/task/{parent}/stat"), cpu(f"/proc/{parent}/stat"),
             int(json.load(open(state)).get("expected", 0))]
    with open(out + ".tmp", "w") as f:
        json.dump({"registered": registered, "samples": samples + [final]}, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
