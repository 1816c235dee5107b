"""(issue 32) The scheduler's memory for the report of N finished trials, through `RunProgress`'s own path:
N records added as the scheduler adds them, then `record()`, `report.build`, report.json written, `summary`.
Each N in a process of its own (its peak RSS is the process's):

    python bench/scripts/report_memory.py 100000 300000

Prints, per N: the RSS the records took while the sweep ran, and the peak over the process's base once the
report was made. Runs against whichever hpc_garage is first on the path (a checkout of an older commit too).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def one(n: int) -> str:
    import psutil

    from hpc_garage.cluster import report
    from hpc_garage.cluster.progress import RunProgress, TrialRecord, WorkerRecord

    with tempfile.TemporaryDirectory() as tmp:
        base = psutil.Process().memory_info().rss
        spool = {"spool_dir": Path(tmp)} if "spool_dir" in RunProgress.__init__.__code__.co_varnames else {}
        progress = RunProgress(lambda figures: None, **spool)
        for w in range(2):
            progress.workers[f"w{w}"] = WorkerRecord(name=f"n0-w{w}", gpus=0, memory_limit=2**32, nthreads=1,
                                                     joined=0.0)
        t = 1.0
        for i in range(n):
            record = TrialRecord(key=f"trial-{os.urandom(16).hex()}", worker=f"n0-w{i % 2}", start=t, stop=t + 0.01,
                                 failed=False, asked_gpu=False)
            if isinstance(progress.trials, dict):  # before cluster/finished_trials.py
                progress.trials[record.key] = record
            else:
                progress.trials.add(record)
            t += 0.0137
        held = psutil.Process().memory_info().rss
        progress.started = 0.0
        made = report.build(progress.record(ended=t + 1))
        if hasattr(report, "write"):
            report.write(Path(tmp) / "report.json", made)
        else:
            from hpc_garage.files import write_json

            write_json(Path(tmp) / "report.json", made)
        report.summary(made)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        size = (Path(tmp) / "report.json").stat().st_size
    return (f"{n:>7,} trials: records {(held - base) / 2**20:6.1f} MiB while the sweep ran; peak "
            f"{(peak - base) / 2**20:6.1f} MiB over the base with the report made; report.json {size / 2**20:.1f} MiB")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(one(int(argv[1])))
        return 0
    for n in argv or ["100000", "300000"]:
        done = subprocess.run([sys.executable, __file__, "--one", n], capture_output=True, text=True)
        print(done.stdout.strip() or done.stderr.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
