"""GPUs, per vendor, as pure functions: reading a job's own GPU list, the variables that pin one worker to its
GPUs, and which cores each worker of a node is bound to. Nothing here reads the environment or a file: the
caller passes the variables (`env`) and the node's topology in.

Masking, per vendor (the README's "GPUs" section says the same for users):

- NVIDIA: `CUDA_VISIBLE_DEVICES` lists integers (positions in CUDA's order), `GPU-…` UUIDs or `MIG-…` MIG
  instances. A worker gets its ids verbatim. CUDA makes one MIG instance visible to a process, so a worker
  gets at most one.
- AMD: ROCm masks in stages. ROCr applies `ROCR_VISIBLE_DEVICES` (integers or `GPU-…` UUIDs) to the node's
  GPUs; HIP (`HIP_VISIBLE_DEVICES`, or `CUDA_VISIBLE_DEVICES`) and ROCclr (`GPU_DEVICE_ORDINAL`, HIP and
  OpenCL) then index into what ROCr left. Setting both stages to the same physical id (the old rule here)
  leaves worker 5 asking for position 5 of a one-GPU list: no GPU. So a worker gets `ROCR_VISIBLE_DEVICES` =
  its physical ids and every later-stage variable = `0,…,k-1` (all of what ROCr left): whichever of them a
  runtime reads, and in whatever order, it sees exactly the worker's GPUs. A job's own list is read the same
  way: ROCR_VISIBLE_DEVICES first, then the later stage indexing into it (Frontier and LUMI set only
  ROCR_VISIBLE_DEVICES; Slurm's default writes the same list into each variable, read as one list).
- Intel: Level Zero's `ZE_AFFINITY_MASK` lists devices (`0`) or tiles (`0.1`); a worker gets its entries.

A worker with no GPU on a GPU node is hidden from all of them: `CUDA_VISIBLE_DEVICES=""` (NVIDIA), `-1`,
an id no node has, for each AMD variable and for `ZE_AFFINITY_MASK` (Level Zero and ROCr read an empty value
as unset: every GPU).

CPU binding: each worker gets `share` CPUs (its CPU resource) of the ones the job may use, preferring those
local to its GPUs (the PCI device's `local_cpulist`), split evenly among the workers whose GPUs share a NUMA
domain, whole cores (hyperthread siblings) kept together where it can. `bind()` says in words where it had to
fall back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hpc_garage.core.errors import AllocationError, LayoutError

VENDORS = ("nvidia", "amd", "intel")
CUDA = "CUDA_VISIBLE_DEVICES"
ROCR = "ROCR_VISIBLE_DEVICES"
HIP = "HIP_VISIBLE_DEVICES"
ORDINAL = "GPU_DEVICE_ORDINAL"
ZE = "ZE_AFFINITY_MASK"
ONEAPI_SELECTOR = "ONEAPI_DEVICE_SELECTOR"
AMD_LATER = (HIP, CUDA, ORDINAL)  # ROCm's second stage: indexes into what ROCR_VISIBLE_DEVICES left
HIDDEN = "-1"  # an id no node has: AMD and Intel runtimes then show no GPU (an empty value means "all")

# the variables each vendor's workers are pinned with, in the order `worker_env` writes them
VARIABLES: dict[str, tuple[str, ...]] = {"nvidia": (CUDA,), "amd": (ROCR, HIP, CUDA, ORDINAL), "intel": (ZE,)}
# the variable whose value names a worker's GPUs (what `show` prints)
PRIMARY = {"nvidia": CUDA, "amd": ROCR, "intel": ZE}

_INT = re.compile(r"\d+")
_NVIDIA_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/.-]*")
_AMD_UUID = re.compile(r"GPU-[0-9A-Fa-f][0-9A-Fa-f-]*")
_TILE = re.compile(r"(\d+)(?:\.(\d+))?")


def vendor_of(gpu: str | Iterable[str]) -> str:
    """A vendor name, given one or given the site's `gpu_env_vars` as older callers pass them."""
    if isinstance(gpu, str):
        if gpu not in VARIABLES:
            raise ValueError(f"unknown GPU vendor {gpu!r}; one of {', '.join(VENDORS)}")
        return gpu
    names = set(gpu)
    return "amd" if ROCR in names else "intel" if ZE in names else "nvidia"


# ------------------------------------------------------------------------------------------ a worker's pinning


def worker_env(vendor: str, ids: Sequence[str]) -> dict[str, str]:
    """The variables that make exactly `ids` (as the job writes them) visible to one worker, on `vendor`'s
    runtimes; with no ids, the ones that hide every GPU."""
    vendor = vendor_of(vendor)
    if vendor == "nvidia":
        if sum(i.startswith("MIG-") for i in ids) > 1:
            raise LayoutError(f"a worker would get MIG instances {','.join(ids)}, but CUDA makes one MIG instance "
                              "visible to a process; give each worker one GPU (workers.per: gpu)")
        return {CUDA: ",".join(ids)}
    if vendor == "amd":
        if not ids:
            return {var: HIDDEN for var in VARIABLES["amd"]}
        later = ",".join(str(k) for k in range(len(ids)))  # every GPU ROCr left, in its order
        return {ROCR: ",".join(ids), HIP: later, CUDA: later, ORDINAL: later}
    return {ZE: ",".join(ids) if ids else HIDDEN}


def pinned(vendor: str, env: Mapping[str, str]) -> str | None:
    """The ids a worker's environment names (its primary variable), or None where it sets none."""
    value = env.get(PRIMARY[vendor_of(vendor)])
    return None if value is None else "" if value == HIDDEN and vendor != "nvidia" else value


# ------------------------------------------------------------------------------------------- the job's GPU list


@dataclass(frozen=True)
class GpuList:
    """A job's GPU ids as its own environment gives them, and where from.

    `variable` is None where no variable lists GPUs at all; `value` is the text read (for messages).
    `ids` may be empty while `variable` is set (an empty list, `NoDevFiles`): whether that is an error
    depends on what the job was granted, which the batch system knows.
    """

    ids: tuple[str, ...] = ()
    variable: str | None = None
    value: str = ""
    notes: tuple[str, ...] = ()

    @property
    def given(self) -> bool:
        return self.variable is not None

    def named(self) -> str:
        """`VAR=value`, for messages."""
        return f"{self.variable}={self.value}" if self.variable else "no GPU list"


EMPTY_WORDS = ("", "NoDevFiles")  # Slurm writes NoDevFiles for a GPU gres that has no device files


def job_gpus(vendor: str, env: Mapping[str, str]) -> GpuList:
    """The job's GPU list for `vendor`, checked: duplicates, blank or malformed entries, a later ROCm stage
    that indexes past the first, are one-line errors naming the variable and its value. Never a guess."""
    vendor = vendor_of(vendor)
    if vendor == "nvidia":
        return _checked_list(env, CUDA, _nvidia_id)
    if vendor == "intel":
        found = _checked_list(env, ZE, _intel_id)
        _no_overlapping_tiles(found)
        selector = env.get(ONEAPI_SELECTOR, "")
        if re.search(r":[^;]*\d", selector):
            raise AllocationError(
                f"{ONEAPI_SELECTOR}={selector} selects GPUs by number, and SYCL counts them after {ZE}, which "
                f"hpc-garage sets per worker; unset {ONEAPI_SELECTOR} or select without numbers (level_zero:gpu)")
        return found
    return _amd_gpus(env)


def _amd_gpus(env: Mapping[str, str]) -> GpuList:
    later = [(var, env[var].strip()) for var in AMD_LATER if var in env]
    if len({value for _, value in later}) > 1:
        shown = " and ".join(f"{var}={value}" for var, value in later)
        raise AllocationError(f"{shown} disagree; ROCm's runtimes read different ones (HIP, OpenCL), so the "
                              "job's GPUs are unclear; unset all but one, or give each the same list")
    first = _checked_list(env, ROCR, _amd_id) if ROCR in env else None
    second = _checked_list(env, later[0][0], _amd_id) if later else None
    if second is None:
        return first or GpuList()
    if first is None:  # no ROCr stage: HIP's positions are ROCr's
        return second
    if second.ids == first.ids or not first.ids:
        note = (f"{first.variable} and {', '.join(var for var, _ in later)} list the same GPUs: read as one list "
                "(each worker's are set afresh)") if first.ids and second.ids else None
        return GpuList(first.ids, first.variable, first.value, (note,) if note else ())
    chosen = []
    for entry in second.ids:
        if _INT.fullmatch(entry):
            if int(entry) >= len(first.ids):
                raise AllocationError(
                    f"{second.named()} asks for GPU {entry} of the {len(first.ids)} that {first.named()} leaves "
                    f"(ROCm applies {ROCR} first, then indexes into what is left); fix or unset {second.variable}")
            chosen.append(first.ids[int(entry)])
        elif entry in first.ids:
            chosen.append(entry)
        else:
            raise AllocationError(f"{second.named()} names {entry}, which {first.named()} hides; fix or unset "
                                  f"{second.variable}")
    _no_duplicates(chosen, f"{first.named()} then {second.named()}")
    return GpuList(tuple(chosen), f"{ROCR} then {second.variable}", f"{first.value} then {second.value}",
                   (f"GPUs {','.join(chosen)}: {second.named()} indexes into {first.named()}",))


def _checked_list(env: Mapping[str, str], variable: str, valid: re.Pattern[str] | None) -> GpuList:
    raw = env.get(variable)
    if raw is None:
        return GpuList()
    value = raw.strip()
    if value in EMPTY_WORDS:
        return GpuList((), variable, raw)
    entries = [x.strip() for x in value.split(",")]
    if any(not x for x in entries):
        raise AllocationError(f"{variable}={raw} has an empty entry; the job's GPU list is malformed (was it "
                              "edited by hand?); fix or unset it")
    bad = [x for x in entries if valid is not None and not valid.fullmatch(x)]
    if bad:
        raise AllocationError(f"{variable}={raw}: {bad[0]!r} is not a GPU id (a number or a UUID); fix or unset it")
    _no_duplicates(entries, f"{variable}={raw}")
    return GpuList(tuple(entries), variable, raw)


def _no_duplicates(entries: Sequence[str], named: str) -> None:
    keys = [str(int(x)) if _INT.fullmatch(x) else x for x in entries]
    twice = sorted({x for x in keys if keys.count(x) > 1})
    if twice:
        raise AllocationError(f"{named} lists GPU {twice[0]} twice: two workers would share it; fix the job's GPU "
                              "list or unset it")


def _no_overlapping_tiles(found: GpuList) -> None:
    whole = {x for x in found.ids if "." not in x}
    for entry in found.ids:
        if "." in entry and entry.split(".")[0] in whole:
            raise AllocationError(f"{found.named()} lists tile {entry} and its whole device {entry.split('.')[0]}: "
                                  "two workers would share it; list devices or tiles, not both")


_nvidia_id = re.compile(f"{_INT.pattern}|{_NVIDIA_UUID.pattern}")
_amd_id = re.compile(f"{_INT.pattern}|{_AMD_UUID.pattern}")
_intel_id = _TILE


def device_of(vendor: str, gpu_id: str) -> str:
    """The id of the whole device a job id is part of: an Intel tile's device (`1.0` → `1`), else itself."""
    return gpu_id.split(".")[0] if vendor == "intel" else gpu_id


# ---------------------------------------------------------------------------------------------- CPU binding


def parse_cpulist(text: str) -> frozenset[int]:
    """`0-3,8,10-11` (sysfs `local_cpulist`, `Cpus_allowed_list`) as a set; ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The shortest `0-3,8` form of a set of CPUs."""
    ordered = sorted(set(cpus))
    runs: list[list[int]] = []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class Topology:
    """What one node says about its CPUs and GPUs, read there (`launchers`), as plain data.

    `allowed`: the CPUs this job's processes may run on (sched_getaffinity). `local`: per job GPU id, the
    CPUs local to its PCI device (absent: unknown, and `unknown` says why). `siblings`: per CPU, the CPUs of
    its core (hyperthreads); absent means a core of its own. `buses`: per job GPU id, its PCI bus id.
    """

    allowed: frozenset[int]
    local: Mapping[str, frozenset[int]] = field(default_factory=dict)
    siblings: Mapping[int, frozenset[int]] = field(default_factory=dict)
    buses: Mapping[str, str] = field(default_factory=dict)
    unknown: str = ""  # why some GPU has no locality (said in the fallback note)


@dataclass(frozen=True)
class Binding:
    """Per worker, the CPUs it is bound to (empty: not bound), and what was assumed, in words."""

    cpus: tuple[tuple[int, ...], ...]
    notes: tuple[str, ...] = ()
    local: bool = False  # the cores were chosen next to each worker's GPUs


def bind(shares: Sequence[int], gpus: Sequence[Sequence[str]], topology: Topology) -> Binding:
    """Each worker's CPUs: `shares[k]` of the allowed CPUs (its CPU resource), disjoint, next to its GPUs
    `gpus[k]` where the topology says where they are, else an even split in CPU order (said in a note).

    Nothing is bound where the job may use fewer CPUs than the workers' shares add up to: the allocation and
    the CPUs the job can run on disagree, and a smaller share would be a guess (said in a note).
    """
    count, total = len(shares), sum(shares)
    allowed = sorted(topology.allowed)
    if not count or total <= 0:
        return Binding(((),) * count)
    if len(allowed) < total:
        return Binding(((),) * count, (f"the job may run on {len(allowed)} CPUs ({format_cpulist(allowed)}, "
                                       f"sched_getaffinity) but its {count} workers' shares add up to {total}; "
                                       "workers not bound",))
    units = _cores(allowed, topology.siblings)
    wants: list[frozenset[int] | None] = []
    missing = [g for ids in gpus for g in ids if g not in topology.local]
    notes: list[str] = []
    if any(gpus) and missing:
        why = f" ({topology.unknown})" if topology.unknown else ""
        notes.append(f"no GPU-to-core mapping for GPU {', '.join(missing[:4])}{why}; cores split evenly")
        wants = [None] * count
    else:
        wants = [frozenset().union(*(topology.local[g] for g in ids)) & topology.allowed if ids else None
                 for ids in gpus]
    taken: list[list[int]] = [[] for _ in range(count)]
    free = list(units)
    # GPU workers first, the most constrained NUMA domain first; workers sharing one split it evenly
    groups: dict[frozenset[int], list[int]] = {}
    for k, want in enumerate(wants):
        if want is not None:
            groups.setdefault(want, []).append(k)
    for want, members in sorted(groups.items(), key=lambda item: (len(item[0]), min(item[1]))):
        near = [u for u in free if set(u) <= want]
        each = min(min(shares[k] for k in members), sum(len(u) for u in near) // len(members))
        for k in members:
            _take(taken[k], near, free, each)
    far = [k for k in range(count) if wants[k] is not None and len(taken[k]) < shares[k]]
    for k in range(count):  # what is still missing: the rest, in CPU order (an even split where nothing is known)
        _take(taken[k], free, free, shares[k] - len(taken[k]))
    if far:
        names = ", ".join(f"GPU {','.join(gpus[k])}" for k in far[:4])
        notes.append(f"the workers of {names} got cores away from their GPU too: fewer of the job's CPUs are "
                     "next to it than the workers there need")
    local = not missing and any(gpus)
    return Binding(tuple(tuple(sorted(t)) for t in taken), tuple(notes), local)


def _cores(allowed: Sequence[int], siblings: Mapping[int, frozenset[int]]) -> list[tuple[int, ...]]:
    """The allowed CPUs grouped by physical core (hyperthread siblings together), in CPU order."""
    allowed_set, seen, units = set(allowed), set(), []
    for cpu in allowed:
        if cpu in seen:
            continue
        unit = tuple(sorted((siblings.get(cpu, frozenset()) | {cpu}) & allowed_set - seen))
        seen.update(unit)
        units.append(unit)
    return units


def _take(mine: list[int], source: list[tuple[int, ...]], free: list[tuple[int, ...]], wanted: int) -> None:
    """Move up to `wanted` CPUs, whole cores first, from `source` (a view of `free`) to `mine`; a core split
    to hit the count exactly leaves its other CPUs free."""
    while wanted > 0 and source:
        unit = source.pop(0)
        if unit in free and source is not free:
            free.remove(unit)
        mine.extend(unit[:wanted])
        if len(unit) > wanted:
            rest = unit[wanted:]
            source.insert(0, rest)
            if source is not free:
                free.insert(0, rest)
        wanted -= min(wanted, len(unit))
