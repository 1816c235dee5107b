"""What every batch system adapter shares: reading GPU ids, running its commands, failing in one line."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from hpc_garage.errors import AllocationError, UserError

if TYPE_CHECKING:
    from hpc_garage.allocation import Allocation
    from hpc_garage.site import Site


class BatchSystem:
    """One batch system: how to read a job's allocation, and (in subclasses) request, submit, query, cancel."""

    name: ClassVar[str]

    def allocation_from_env(self, env: Mapping[str, str], site: Site) -> Allocation:
        raise NotImplementedError

    def run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60) -> str:
        """Run one of the batch system's commands; its failure becomes one line naming the command."""
        try:
            done = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise UserError(f"{argv[0]}: command not found; is the {self.name} client installed and on PATH?") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"`{shlex.join(argv)}` did not answer within {timeout:.0f} s; try again") from None
        if done.returncode != 0:
            said = " ".join((done.stderr or done.stdout).split()) or f"exit code {done.returncode}"
            raise UserError(f"{argv[0]} failed: {said}")
        return done.stdout


def visible_gpus(env: Mapping[str, str], count_var: str | None, *also: str) -> tuple[tuple[str, ...], list[str]]:
    """The GPU ids this job's processes can use, as they must write them in CUDA_VISIBLE_DEVICES.

    CUDA_VISIBLE_DEVICES is what the job sees (cgroup-relative ints, or `GPU-…`/`MIG-…` UUIDs); other
    variables (SLURM_JOB_GPUS: global ids) only cross-check the count. A mismatch is an error, not a guess.
    Returns the ids and notes about assumptions.
    """
    notes: list[str] = []
    raw = env.get("CUDA_VISIBLE_DEVICES")
    count = _int(env, count_var) if count_var and env.get(count_var) else None
    if raw is not None and raw.strip() not in ("", "NoDevFiles"):
        ids = tuple(x.strip() for x in raw.split(",") if x.strip())
        if count is not None and count != len(ids):
            raise AllocationError(
                f"CUDA_VISIBLE_DEVICES={raw} lists {len(ids)} GPUs but {count_var}={count}; "
                "unset the one you changed by hand"
            )
        for var in also:
            other = [x for x in env.get(var, "").split(",") if x.strip()]
            if other and len(other) != len(ids):
                raise AllocationError(
                    f"CUDA_VISIBLE_DEVICES={raw} lists {len(ids)} GPUs but {var}={env[var]} lists {len(other)}; "
                    "unset the one you changed by hand"
                )
        return ids, notes
    if count:
        notes.append(f"CUDA_VISIBLE_DEVICES is not set; using GPU ids 0..{count - 1} from {count_var}={count}")
        return tuple(str(i) for i in range(count)), notes
    return (), notes


def _int(env: Mapping[str, str], var: str) -> int:
    value = env.get(var, "")
    try:
        return int(value.strip())
    except ValueError:
        raise AllocationError(f"{var}={value!r} is not a whole number; check the job's environment") from None


def require(env: Mapping[str, str], var: str, why: str) -> str:
    value = env.get(var, "").strip()
    if not value:
        raise AllocationError(f"{var} is not set, so {why}; run inside the job, or pass request flags")
    return value
