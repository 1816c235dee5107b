"""`dask-resource:NAME=VALUE` task tags: how a Prefect task asks Dask for a worker's resources.

The spelling is Prefect 1's (`dask-resource:GPU=1`), kept so garage-era flows need no edits. Prefect 3's
DaskTaskRunner ignores these tags; `hpc_garage.prefect.HpcTaskRunner` reads them with `resources_from_tags`.
A malformed tag is an error, never skipped: a GPU task silently placed anywhere is the bug this prevents.
Pure, no heavy imports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from hpc_garage.core.errors import UserError
from hpc_garage.core.units import parse_memory

PREFIX = "dask-resource:"
FORM = "dask-resource:NAME=VALUE with a number >= 0, e.g. dask-resource:GPU=1 or dask-resource:MEMORY=10e9"


def resource_tags(
    gpu: float = 0, cpu: float = 0, memory: str | int | float = 0, process: float = 0
) -> list[str]:
    """Tags for `@task(tags=...)`; memory as bytes or `10GB`/`10GiB`. Zero asks for nothing, so no tag."""
    amounts = {"GPU": _amount("gpu", gpu), "CPU": _amount("cpu", cpu), "MEMORY": _bytes(memory),
               "PROCESS": _amount("process", process)}
    return [f"{PREFIX}{name}={_number(value)}" for name, value in amounts.items() if value]


def resources_from_tags(tags: Iterable[str]) -> dict[str, float]:
    """The Dask resources the tags ask for; other tags are ignored, malformed resource tags refused."""
    resources: dict[str, float] = {}
    seen: dict[str, str] = {}
    for tag in sorted(tags):
        if not tag.startswith(PREFIX):
            continue
        name, value = _parse(tag)
        if name in resources and resources[name] != value:
            raise UserError(f"task tags {seen[name]!r} and {tag!r} ask for different amounts of {name}; keep one")
        resources[name], seen[name] = value, tag
    return resources


def _parse(tag: str) -> tuple[str, float]:
    name, sep, text = tag[len(PREFIX):].partition("=")
    name, text = name.strip(), text.strip()
    if not sep or not name or any(c.isspace() for c in name):
        raise UserError(f"malformed task tag {tag!r}; write {FORM}")
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"task tag {tag!r}: {text!r} is not a number; write {FORM}") from None
    if not math.isfinite(value) or value < 0:
        raise UserError(f"task tag {tag!r}: {text} is not a number >= 0; write {FORM}")
    return name, value


def _amount(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise UserError(f"resources({name}={value!r}): expected a number >= 0")
    return value


def _bytes(memory: str | int | float) -> int:
    """Bytes: a number is bytes already; a string needs a unit (`10GB`), as in site files."""
    if isinstance(memory, str):
        try:
            return parse_memory(memory, bare=None)
        except ValueError as exc:
            raise UserError(f"resources(memory={memory!r}): {exc}") from None
    return int(_amount("memory", memory))


def _number(value: float) -> str:
    """`1`, not `1.0`, for whole amounts; floats keep every digit so the tag parses back to the same value."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
