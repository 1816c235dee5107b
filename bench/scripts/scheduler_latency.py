"""How fast the Dask scheduler answers, sampled from a process of its own: one `client.scheduler_info()` round
trip (the scheduler's `identity` handler, on its event loop) every `--every` seconds until stdin closes.

    python scheduler_latency.py ADDRESS OUT.json [--every 0.02]

OUT.json: {"samples": [[wall time at the call, seconds it took], ...]}. A process of its own, so that neither
the flow process's threads (the metrics drain) nor the trials' GIL delay the measuring side: what is left is
the scheduler's own event loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("out")
    parser.add_argument("--every", type=float, default=0.02)
    args = parser.parse_args()
    from distributed import Client

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    samples: list[list[float]] = []
    with Client(args.address, timeout=60) as client:
        print("ready", flush=True)
        while not stop.is_set():
            at = time.time()
            start = time.perf_counter()
            client.scheduler_info(n_workers=0)
            samples.append([at, time.perf_counter() - start])
            stop.wait(args.every)
    Path(args.out).write_text(json.dumps({"samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
