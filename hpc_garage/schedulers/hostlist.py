"""Slurm's compressed host and count lists (`nid[001-004]`, `72(x2),36`), expanded as Slurm does: pure text."""

from __future__ import annotations

import itertools
import re

from hpc_garage.core.errors import AllocationError

_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_counts(spec: str, var: str = "count list") -> list[int]:
    """`72(x2),36` → [72, 72, 36] (Slurm's compressed per-node counts)."""
    out: list[int] = []
    for part in spec.split(","):
        m = _COUNT.match(part.strip())
        if not m:
            raise AllocationError(f"{var}={spec}: cannot read {part!r}; expected forms like 72(x2),36")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist as `scontrol show hostnames` does: `nid[001234-001237,001300]`, `a[1-2]-b[1-2]`."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append(_expand_ranges(piece[1:-1], hostlist))
            elif "[" in piece or "]" in piece:
                raise AllocationError(f"hostlist {hostlist!r} has unbalanced brackets")
            else:
                choices.append([piece])
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    if not hosts or any(not h for h in hosts):
        raise AllocationError(f"hostlist {hostlist!r} names no hosts")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise AllocationError(f"hostlist {text!r} has unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise AllocationError(f"hostlist {text!r} has unbalanced brackets")
    return [i for i in items + [current] if i]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out = []
    for r in ranges.split(","):
        lo, _, hi = r.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise AllocationError(f"hostlist {hostlist!r}: cannot read range {r!r}")
        if not hi:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise AllocationError(f"hostlist {hostlist!r}: range {r!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out
