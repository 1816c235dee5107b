"""(8) What serving Prefect's UI costs the managed Prefect server: start -> first authenticated answer, with the
UI (the default) and without (HPC_GARAGE_PREFECT_UI=0), on a fresh PREFECT_HOME (database migrations, and
Prefect copying its UI into PREFECT_HOME/ui_build) and on a reused one (a restart after an idle stop); and the
server's memory once up (RSS of `prefect server start` and its children; the keeper is not counted).

    python -m bench.server_ui --runs 5 --out ui.json

Each start is `hpc_garage.prefect.server.ensure_server()` in a private HOME, so no other server is reused.
The two modes alternate within each run, so a busy machine colours both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import Figure, compare, ratio_to_best, say, scratch

WITH = "with Prefect's UI (default)"
WITHOUT = "without it (HPC_GARAGE_PREFECT_UI=0)"
SETTLE = 5.0  # s after the first answer before memory is read: services start in the background


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    samples: dict[str, list[dict[str, float]]] = {WITH: [], WITHOUT: []}
    copied_mib = 0.0
    for i in range(args.runs):
        for label in (WITH, WITHOUT) if i % 2 == 0 else (WITHOUT, WITH):
            home = scratch("server-ui-")
            try:
                sample = _starts(home, ui=label == WITH)
                if label == WITH:
                    copied_mib = _mib(home)
            finally:
                shutil.rmtree(home, ignore_errors=True)
            samples[label].append(sample)
            say(f"server UI run {i + 1}/{args.runs}: {label}: fresh {sample['fresh']:.1f} s, reused "
                f"{sample['reused']:.1f} s, {sample['rss']:.0f} MiB")
    figures: list[Figure] = []
    for key, group, unit, goal, limit in (
            ("fresh", "managed Prefect server, fresh PREFECT_HOME: start -> first authenticated answer", "s",
             "<= 1.5x without (the UI is copied once)", 1.5),
            ("reused", "managed Prefect server, PREFECT_HOME reused: start -> first authenticated answer", "s",
             "<= 1.2x without", 1.2),
            ("rss", "managed Prefect server: memory once up (RSS, server and children)", "MiB",
             "<= 1.1x without", 1.1)):
        block = [Figure(group, label, unit, [s[key] for s in samples[label]], ours=label == WITH,
                        note=f"the UI's copy in PREFECT_HOME: {copied_mib:.0f} MiB" if key == "fresh" and
                        label == WITH else "") for label in (WITH, WITHOUT)]
        compare(block, goal, lambda ours, peers, limit=limit: ratio_to_best(ours, peers) <= limit)
        figures += block
    Path(args.out).write_text(json.dumps({"figures": [f.to_dict() for f in figures]}, indent=2))
    return 0


def _starts(home: Path, *, ui: bool) -> dict[str, float]:
    """Start a server in `home` (fresh), read its memory, stop it, start it again (reused), stop it."""
    from hpc_garage.prefect import server

    saved = {k: os.environ.get(k) for k in ("HOME", "HPC_GARAGE_PREFECT_UI", "PREFECT_API_URL")}
    os.environ.update(HOME=str(home), HPC_GARAGE_PREFECT_UI="1" if ui else "0")
    os.environ.pop("PREFECT_API_URL", None)
    try:
        sample = {}
        for key in ("fresh", "reused"):
            started = time.monotonic()
            state = server.ensure_server()
            sample[key] = time.monotonic() - started
            if key == "fresh":
                time.sleep(SETTLE)
                if state.ui:
                    _get(f"{state.ui}/")  # a browser's first page: the static files' route is used once
                sample["rss"] = _rss_mib(state.pid)
            server.stop_server()
        return sample
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _get(url: str) -> None:
    request = urllib.request.Request(url, headers={"Accept": "text/html"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as answer:
        answer.read()


def _rss_mib(keeper: int) -> float:
    """The keeper's children and theirs (`prefect server start`, its uvicorn), not the keeper itself."""
    import psutil

    total = 0
    for process in psutil.Process(keeper).children(recursive=True):
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def _mib(home: Path) -> float:
    build = next(home.glob(".hpc-garage/prefect/*/home/ui_build"), None)
    if build is None:
        return 0.0
    return sum(p.stat().st_size for p in build.rglob("*") if p.is_file()) / 2**20


if __name__ == "__main__":
    raise SystemExit(main())
