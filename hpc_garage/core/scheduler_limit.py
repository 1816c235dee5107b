"""How many workers one Dask scheduler was measured to hold, and the one line `show` and `submit` say past it.

Every hpc-garage run has one scheduler (in `run`'s process), whichever launcher starts the workers. Past the
largest size the workers benchmark (bench/workers.py) measured holding, registration and heartbeats are not
known to hold, so a request for more workers is told so: a note from `show`, a warning from `submit` (the job is
still submitted: a site's scheduler node may well hold more than this 2-core machine did).
"""

from __future__ import annotations

# bench/results/runs/20261127-223909-workers.md (`python -m bench --only workers`, the largest size measured):
# 1,024 TLS workers on one scheduler process registered in 26.8 s (load 16.7 on 2 cores) and none was removed
# through 5,000 tasks over them. In 20261127-222609-workers.md, at load 22, 1,024 did not register within
# 600 s, 512 did in 10.9 s: on a shared machine the limit follows the load. Larger sizes are unmeasured, not
# known to fail (distributed #3691: about 1,900 workers on Summit, then lost to heartbeats). Re-measured on an
# idle machine (load 0.5 at the start), bench/results/runs/20261128-010836-workers.md: 128/256/512/1,024
# registered in 0.4/0.3/2.9/12.2 s; 50,000 tasks over the 1,024 for 779 s at load ~40 with heartbeats up to
# 82 s late, under the 300 s worker TTL: none removed.
ONE_SCHEDULER_WORKERS = 1024

HOW_TO = "docs/how-to/large-jobs.md"


def past_one_scheduler(workers: int, limit: int = ONE_SCHEDULER_WORKERS) -> str | None:
    """The line to say when `workers` exceed what one scheduler was measured to hold; None within it."""
    if workers <= limit:
        return None
    return (f"{workers:,} workers on one Dask scheduler: more than the {limit:,} measured to hold "
            f"(bench/workers.py); split the sweep over several jobs of at most {limit:,} workers each "
            f"(see {HOW_TO})")
