"""Memory sizes and walltimes as HPC users write them.

Scheduler conventions win where they differ from Dask's: a bare number of memory is MiB (`sbatch --mem=4000`),
a one-letter suffix is binary (`--mem=64G` is 64 GiB in Slurm), and so is PBS's lower-case `mem=2gb`, and a bare walltime number is
minutes (`sbatch -t 90`). Everything else (`64GB`, `60 GiB`, `2h`, `90min`) goes to dask.utils.
"""

from __future__ import annotations

import math
import re

_SLURM_SUFFIX = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP])\s*$", re.IGNORECASE)
_PBS_SUFFIX = re.compile(r"^\s*(\d+)\s*([kmgtp])b\s*$")  # lower case, as PBS writes mem=2gb
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_SIZE = re.compile(r"^(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([KMGTP]i?B?|B)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1} | {
    f"{p}{suffix}": (1000 ** (i + 1) if suffix in ("b",) else 2 ** (10 * (i + 1)))
    for i, p in enumerate("kmgtp")
    for suffix in ("b", "ib", "i")
}
_CLOCK = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_memory(value: str | int | float, *, bare: str | None = "MiB") -> int:
    """Bytes from `64GiB`, `64GB`, `64G` (binary, as sbatch/qsub read it), `2gb` (PBS, binary) or `4000` (MiB).

    `bare=None` refuses a number without a unit (site files, where `memory: 256` is almost surely a slip).
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a memory size")
    text = str(value).strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        if bare is None:
            raise ValueError(f"{text!r} has no unit; write e.g. '{text}GiB' or '{text}GB'")
        return _bytes(float(text) * _BINARY[bare[0].lower()], text)
    if m := _SLURM_SUFFIX.match(text):
        return _bytes(float(m.group(1)) * _BINARY[m.group(2).lower()], text)
    if m := _PBS_SUFFIX.match(text):
        return _bytes(int(m.group(1)) * _BINARY[m.group(2)], text)  # PBS: 'gb' means GiB
    if m := _SIZE.match(text):  # dask.utils.parse_bytes' own units, without the ~180 ms `import dask`
        if not m.group(2) and bare is None:  # `1e12` where `64` is refused: a unit is wanted here too
            raise ValueError(f"{text!r} has no unit; write e.g. '1TB' or '931GiB'")
        if (unit := _UNITS.get((m.group(2) or "").lower())) is not None:
            return _bytes(float(m.group(1)) * unit, text)
    raise ValueError(f"{text!r} is not a memory size; write e.g. '64GiB', '64GB' or '64G'")


MAX_BYTES = 2**60  # an exbibyte: far above any node, far below what overflows


def _bytes(size: float, text: str) -> int:
    if not math.isfinite(size) or size > MAX_BYTES:
        raise ValueError(f"{text!r} is beyond any machine's memory; write e.g. '64GiB'")
    return int(size)


def parse_walltime(value: str | int | float) -> int:
    """Seconds from Slurm's forms (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH[:MM[:SS]]`) or durations (`2h`, `90min`)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a walltime")
    text = str(value).strip()
    if m := _CLOCK.match(text):
        days, a, b, c = m.groups()
        parts = [int(x) for x in (a, b, c) if x is not None]
        if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
            hours, minutes, seconds = (parts + [0, 0])[:3]
            _clock_fields(text, hours=(hours, 24), minutes=(minutes, 60), seconds=(seconds, 60))
            return _duration(int(days) * 86400 + hours * 3600 + minutes * 60 + seconds, text)
        if len(parts) == 1 and parts[0] > 0:
            return _duration(parts[0] * 60, text)  # bare number: minutes, like sbatch -t
        if len(parts) == 1:
            raise ValueError(f"{text!r} is not a walltime; write e.g. '01:30:00' or '90' (minutes)")
        if len(parts) == 2:
            _clock_fields(text, seconds=(parts[1], 60))
            return _duration(parts[0] * 60 + parts[1], text)
        _clock_fields(text, minutes=(parts[1], 60), seconds=(parts[2], 60))
        return _duration(parts[0] * 3600 + parts[1] * 60 + parts[2], text)
    if re.fullmatch(r"\d*\.\d*", text):  # `90.0`: minutes, as `90` is, or seconds, as Dask reads it?
        raise ValueError(f"{text!r} is ambiguous; write '{text.split('.')[0] or 0}' (minutes), "
                         f"'{text}min', '{text}s' or HH:MM:SS")
    from dask.utils import parse_timedelta

    try:
        seconds = parse_timedelta(re.sub(r"(?<=\d)\s*mins?$", "m", text), default="seconds")
    except (ValueError, KeyError, TypeError, OverflowError, IndexError):
        seconds = None
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f"{text!r} is not a walltime; write e.g. '01:30:00', '1-00:00:00' or '90min'")
    return _duration(seconds, text)


def _duration(seconds: float, text: str) -> int:
    if not 1 <= seconds <= MAX_SECONDS:
        raise ValueError(f"{text!r} is not a walltime (a second to ten years); write e.g. "
                         "'01:30:00', '1-00:00:00' or '90min'")
    return int(seconds)


MAX_SECONDS = 10 * 365 * 86400  # ten years: beyond any batch system's limit, far below an overflow


def _clock_fields(text: str, **fields: tuple[int, int]) -> None:
    """Refuse `1:99:00` rather than read it as 2:39:00: a slip, not a time."""
    for name, (value, limit) in fields.items():
        if value >= limit:
            raise ValueError(f"{text!r}: {value} {name} is not a clock value (0-{limit - 1}); "
                             "write e.g. '01:30:00' or '1-00:00:00'")


def format_walltime(seconds: int) -> str:
    """`HH:MM:SS` (hours may exceed 24), which sbatch, qsub and Dask's --lifetime all accept."""
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"


def format_bytes(n: int | float, *, tenths: bool = False) -> str:
    """`60 GiB`, `1.5 GiB`, `512 MiB`: binary, as people read node memory. `tenths`: always one decimal
    (`2.0 GiB`), as a measured figure reads (a peak in the run's report, a trial's GPU memory)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            whole = not tenths and abs(value - round(value)) < 0.05
            return f"{value:.0f} {unit}" if whole else f"{value:.1f} {unit}"
    return f"{round(n)} B"


def mib(n: int) -> int:
    """Whole MiB, rounded down: the unit sbatch --mem and PBS mem=…mb take."""
    return int(n) // 2**20
