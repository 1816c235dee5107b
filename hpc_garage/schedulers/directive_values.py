"""What may stand in a job-script directive: values no directive parser splits or interprets, one line each.

sbatch, PBS Pro and the Torque `qsub` wrapper each split directive lines by their own rules (the wrapper even
passes some through a shell), so what reaches a directive from a command line or a site file is held to a
plain character set here. The batch systems' modules (slurm.py, pbs.py) and the job script (jobscript.py)
check their values with these; this module imports nothing of the others, so none of them imports in a circle.
"""

from __future__ import annotations

import re

from hpc_garage.core.errors import UserError

PLAIN = re.compile(r"[A-Za-z0-9_.,:@%+=/~-]+")  # nothing any directive parser or shell treats specially
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def plain(value: str, what: str) -> str:
    """A directive value that no parser splits or interprets: accounts, partitions, QOS, GPU types."""
    if not PLAIN.fullmatch(value):
        raise UserError(f"{what} {value!r}: use only letters, digits and _ . , : @ % + = / ~ -")
    return value


def path_value(value: str, what: str, *, quote: bool) -> str:
    """A path as a directive value: plain as it is, or (where the parser honours it) in double quotes."""
    if PLAIN.fullmatch(value):
        return value
    if quote and not CONTROL.search(value) and not re.search(r'["\\]', value):
        return f'"{value}"'
    allowed = "no control characters, double quotes or backslashes" if quote else "only letters, digits and _ . , : @ % + = / ~ -"
    raise UserError(f"{what} {value!r}: a path in a job-script directive may contain {allowed}; choose another path")


def directive(line: str, what: str) -> str:
    """One directive line's text (after the prefix): a single line, or it would smuggle in a second one."""
    if CONTROL.search(line.replace("\t", " ")):
        raise UserError(f"{what} {line!r} holds a newline or control character; a directive is one line")
    return line
