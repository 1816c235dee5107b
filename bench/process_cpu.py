"""(issue 32) Where a sweep's CPU goes: CPU seconds by process kind (the workers, the Prefect server, the
scheduler = `run`'s process, the flow) for the scale flow (bench/scale_flow.py: N trivial tagged trials under
`hpc-garage run --site local`, 2 workers), with hpc-garage's worker-side Prefect hooks on, and bypassed
(HPC_GARAGE_BENCH_BYPASS_OUTAGE_HOOKS=1: Prefect's own tag-concurrency path), runs interleaved.

    python -m bench.process_cpu --trials 3000 --runs 3

On 2 cores every process shares them: a CPU second saved anywhere is a trial sooner. Stored as every
benchmark is (bench/results/runs/<date>-process-cpu.{json,md}, and the index).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import BIN, PYTHON, ROOT, Figure, compare, machine, say
from bench.report import store_run, write_index
from bench.scale import kind_of
from hpc_garage.variables import BENCH_BYPASS_ENV

KINDS = ("workers", "server", "scheduler", "flow")


def one(n: int, bypass: bool) -> dict[str, Any]:
    """One flow of `n` trials in a HOME of its own; each process's CPU seconds as last seen (every 0.5 s)."""
    with tempfile.TemporaryDirectory(prefix="hpc-garage-bench-cpu-") as home:
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME", BENCH_BYPASS_ENV)}
        env |= {"HOME": home, "PYTHONPATH": str(ROOT)} | ({BENCH_BYPASS_ENV: "1"} if bypass else {})
        out = Path(home) / "flow.json"
        process = subprocess.Popen([str(BIN / "hpc-garage"), "run", "--site", "local", "--", PYTHON, "-m",
                                    "bench.scale_flow", str(n), str(out), "hpc-garage"], cwd=home, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        last: dict[int, tuple[str, float]] = {}
        tick = os.sysconf("SC_CLK_TCK")
        while process.poll() is None:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if f"HOME={home}".encode() not in Path(f"/proc/{pid}/environ").read_bytes():
                        continue
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    kind = kind_of(int(pid), process.pid, cmd)
                    last[int(pid)] = (kind, (int(stat[11]) + int(stat[12])) / tick)
                except OSError:
                    continue
            time.sleep(0.5)
        subprocess.run([str(BIN / "hpc-garage"), "server", "stop", "--force"], env=env, cwd=home,
                       capture_output=True, timeout=120)
        flow = json.loads(out.read_text()) if out.exists() else {"right": False, "seconds": None}
    cpu = {kind: round(sum(s for k, s in last.values() if k == kind), 1) for kind in KINDS}
    return {"hooks": "bypassed" if bypass else "on", "right": flow["right"], "seconds": flow["seconds"], "cpu_s": cpu}


def section(rows: list[dict[str, Any]], trials: int) -> dict[str, Any]:
    """Figures per process kind (and the flow's seconds): hooks on (ours) against bypassed, same runs."""
    figures = []
    for what, unit, pick in [("flow: first submission -> last result", "s", lambda r: r["seconds"]),
                             *((f"CPU of the {k}", "s", lambda r, k=k: r["cpu_s"][k]) for k in KINDS)]:
        group = f"issue 32 process CPU, {trials:,} trivial tagged trials, 2 workers: {what}"
        for hooks, label in (("on", "hpc-garage (worker hooks on)"), ("bypassed", "Prefect's own path (bypassed)")):
            values = [pick(r) for r in rows if r["hooks"] == hooks and r["right"]]
            figures.append(Figure(group, label, unit, values, ours=hooks == "on"))
    compare(figures, "< 1x bypassed", lambda ours, peers: ours.median < min(p.median for p in peers))
    return {"figures": [f.to_dict() for f in figures], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.process_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    began, about = time.monotonic(), machine()
    rows = []
    for _ in range(args.runs):
        for bypass in (False, True):
            rows.append(one(args.trials, bypass))
            say(f"process cpu: {json.dumps(rows[-1])}")
    found = section(rows, args.trials) | {"seconds": round(time.monotonic() - began, 1)}
    stored = store_run(ROOT / "bench" / "results", "process-cpu", found, about,
                       f"python -m bench.process_cpu --trials {args.trials} --runs {args.runs}", os.getloadavg()[0],
                       args.runs, False)
    write_index(ROOT / "bench" / "results")
    print(stored.with_suffix(".md").read_text())
    return 0 if all(r["right"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
