"""Where a job's start-up CPU goes: every process whose command line names MARKER (or is an hpc-garage node
process, a worker forkserver or a forked worker, or srun), with when it appeared and its CPU seconds over
time, sampled from /proc every 0.1 s for SECONDS; written to OUT.json for reading against the job's start.

    python bench/scripts/process_cpu.py MARKER OUT.json SECONDS &   # then submit the job from a directory
                                                                    # whose name is MARKER
A diagnostic (README, "Start-up in a batch job"), not part of `python -m bench`: it costs some CPU itself.
"""

import json
import os
import sys
import time

NAMES = ("forkserver", "launchers.mpi", "srun")


def main() -> None:
    marker, out, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    tick = os.sysconf("SC_CLK_TCK")
    seen: dict[str, dict] = {}
    start = time.time()
    while time.time() - start < seconds:
        now = time.time()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:200]
                if marker not in cmd and not any(n in cmd for n in NAMES):
                    continue
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / tick
            entry = seen.setdefault(pid, {"cmd": cmd, "first": now, "ppid": int(fields[1]), "cpu": []})
            if not entry["cpu"] or entry["cpu"][-1][1] != cpu:
                entry["cpu"].append((now, cpu))
        time.sleep(0.1)
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
