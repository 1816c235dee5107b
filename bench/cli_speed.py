"""(5) CLI and planning scale: `hpc-garage --help` and `show` against `python -c "import click"`, and
`show --json` for 4,096 nodes x 8 GPUs (a site without a max_nodes limit, written to a temporary directory).

    python -m bench.cli_speed --runs 5 --out cli.json

Every command is run through the real interpreter's own console script, never a pyenv shim (which adds
~100 ms of bash).
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

from bench.common import BIN, PYTHON, Figure, compare, ratio_to_best

HUGE_SITE = """\
# bench: a big GPU partition with no node limit, for planning at scale
scheduler: slurm
launcher: mpi
queue: gpu
walltime: "01:00:00"
node:
  cores: 64
  memory: 512GiB
  gpus: 8
workers:
  per: gpu
"""
START_GROUP = "CLI: command start to exit"
PLAN_GROUP = "planning: `show --json`, 4,096 nodes x 8 GPUs (32,768 workers), beyond start-up"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    Path(args.out).write_text(json.dumps(measure(args.runs, args.nodes), indent=2))
    return 0


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return elapsed, len(done.stdout)


def measure(runs: int, nodes: int) -> dict[str, Any]:
    hpc = str(BIN / "hpc-garage")
    with tempfile.TemporaryDirectory() as sites:
        (Path(sites) / "bench-huge.yaml").write_text(HUGE_SITE)
        env = {**os.environ, "HPC_GARAGE_SITES_PATH": sites}
        commands = {
            "hpc-garage --help": [hpc, "--help"],
            "hpc-garage show --site lab-gpu --nodes 2": [hpc, "show", "--site", "lab-gpu", "--nodes", "2"],
            'python -c "import click"': [PYTHON, "-c", "import click"],
        }
        small = [hpc, "show", "--site", "bench-huge", "--nodes", "1", "--json"]
        big = [hpc, "show", "--site", "bench-huge", "--nodes", str(nodes), "--json"]
        for argv in [*commands.values(), small, big]:  # warm the page cache and .pyc files
            timed(argv, env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        small_t, big_t, size = [], [], 0
        for _ in range(runs):
            for name, argv in commands.items():
                times[name].append(timed(argv, env)[0])
            small_t.append(timed(small, env)[0])
            elapsed, size = timed(big, env)
            big_t.append(elapsed)
    figures = [Figure(START_GROUP, name, "s", values, ours=name.startswith("hpc-garage"))
               for name, values in times.items()]
    compare(figures, '<= 3x `python -c "import click"`', lambda ours, peers: ratio_to_best(ours, peers) <= 3)
    group = PLAN_GROUP if nodes == 4096 else PLAN_GROUP.replace("4,096", str(nodes)).replace("32,768", str(nodes * 8))
    beyond = Figure(group, f"show --json, {nodes} nodes minus 1 node", "s",
                    [b - s for b, s in zip(big_t, small_t)], ours=True, goal="< 0.2 s beyond start-up")
    beyond.met = beyond.median is not None and beyond.median < 0.2
    context = [Figure(group, f"show --json, {nodes} nodes (whole command)", "s", big_t),
               Figure(group, "show --json, 1 node (start-up)", "s", small_t)]
    return {"figures": [f.to_dict() for f in figures + [beyond] + context], "json_bytes": size}


if __name__ == "__main__":
    raise SystemExit(main())
