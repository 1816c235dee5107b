"""What a node says about its GPUs and CPUs, read on the node, and the binding of its workers to cores.

Read here: each GPU's PCI bus id, the CPUs local to that PCI device (sysfs `local_cpulist`), the CPUs this
process may run on (`sched_getaffinity`), and hyperthread siblings. The choice of cores is pure
(`core.gpus.bind`, `core.layout.bind_node`); applying it is the worker's own first step
(`launchers.affinity.BoundWorker`).

Bus ids, in the order the vendor's runtime numbers its GPUs (what an integer id in the job's list means):

- NVIDIA: `nvidia-smi --query-gpu=index,uuid,pci.bus_id` (NVML's order is PCI bus order; CUDA's default
  order is the same on nodes of one GPU model), MIG instances from `nvidia-smi -L`; without nvidia-smi,
  /proc/driver/nvidia/gpus/*/information (bus id, minor, UUID), else NVIDIA's PCI devices in /sys/bus/pci.
- AMD: the KFD topology (/sys/class/kfd/kfd/topology/nodes, ROCr's own order, with the UUIDs ROCr shows),
  else AMD's PCI display devices in bus order.
- Intel: PCI display devices of Intel's i915/xe drivers in bus order (Level Zero's order); a tile `1.0` is
  device 1's.

GPUs whose device file this process may not open (a cgroup that hides them) are left out, as the runtimes
leave them out. `HPC_GARAGE_SYSFS_ROOT=/path` reads /path/sys, /path/proc and /path/dev instead (tests, and
`show` of a node described by such a tree); it never runs nvidia-smi, and takes the allowed CPUs from
/path/proc/self/status where that file exists.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hpc_garage.core import gpus
from hpc_garage.core.layout import Layout, WorkerSpec, bind_node
from hpc_garage.variables import SYSFS_ROOT_ENV

PCI_VENDORS = {"nvidia": "0x10de", "amd": "0x1002", "intel": "0x8086"}
DRIVERS = {"nvidia": ("nvidia",), "amd": ("amdgpu",), "intel": ("i915", "xe")}


@dataclass(frozen=True)
class GpuDevice:
    """One GPU of the node as the vendor's runtime numbers it."""

    bus: str  # PCI bus id, sysfs spelling: 0000:3b:00.0
    uuids: tuple[str, ...] = ()  # GPU-…, and for NVIDIA with MIG its MIG-… instances
    device_file: str | None = None  # what must open for this process to use it


def normal_bus(bus: str) -> str:
    """`00000000:3B:00.0` (nvidia-smi) → `0000:3b:00.0` (sysfs)."""
    domain, _, rest = bus.strip().lower().rpartition(":")
    head, _, bus_no = domain.rpartition(":")
    return f"{int(head or '0', 16):04x}:{bus_no}:{rest}" if bus_no else bus.strip().lower()


def _root(env: Mapping[str, str]) -> Path:
    return Path(env.get(SYSFS_ROOT_ENV) or "/")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _may_open(path: Path) -> bool:
    """False only where the device file exists and opening it is refused (a device cgroup hides the GPU)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except PermissionError:
        return False
    except OSError:
        return True  # missing, busy, or not a device here: no evidence that the job may not use it
    os.close(fd)
    return True


def gpu_devices(vendor: str, env: Mapping[str, str], *, mig: bool = False) -> tuple[list[GpuDevice], str]:
    """The node's GPUs in the runtime's order, and where they were read (or, with none, why)."""
    root = _root(env)
    found: list[GpuDevice] = []
    source = ""
    if vendor == "nvidia":
        if root == Path("/") and shutil.which("nvidia-smi"):
            found, source = _nvidia_smi(mig)
        if not found:
            found, source = _nvidia_proc(root)
    elif vendor == "amd":
        found, source = _kfd(root)
    if not found:
        found, source = _pci(root, vendor)
    usable = [d for d in found if d.device_file is None or _may_open(root / d.device_file.lstrip("/"))]
    if not usable:
        return [], f"no {vendor} GPU found ({source or 'nothing readable'})"
    return usable, source


def _nvidia_smi(mig: bool) -> tuple[list[GpuDevice], str]:
    def run(*args: str) -> str:
        try:
            done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout if done.returncode == 0 else ""

    devices = []
    for line in run("--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            devices.append(GpuDevice(normal_bus(parts[2]), (parts[1],)))
    if mig and devices:  # `GPU 0: … (UUID: GPU-…)` then its `  MIG 1g.5gb Device 0: (UUID: MIG-…)` lines
        instances: dict[str, list[str]] = {}
        parent = None
        for line in run("-L").splitlines():
            m = re.search(r"\(UUID: ((?:GPU|MIG)-[^)]+)\)", line)
            if m and m.group(1).startswith("GPU-"):
                parent = m.group(1)
            elif m and parent:
                instances.setdefault(parent, []).append(m.group(1))
        devices = [replace(d, uuids=d.uuids + tuple(instances.get(d.uuids[0], ()))) for d in devices]
    return devices, "nvidia-smi"


def _nvidia_proc(root: Path) -> tuple[list[GpuDevice], str]:
    base = root / "proc/driver/nvidia/gpus"
    devices = []
    for info_file in sorted(base.glob("*/information")):
        text = _read(info_file) or ""
        fields = dict((k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in text.splitlines()) if v)
        bus = normal_bus(fields.get("Bus Location", info_file.parent.name))
        minor = fields.get("Device Minor", "")
        uuid = fields.get("GPU UUID", "")
        devices.append(GpuDevice(bus, (uuid,) if uuid.startswith("GPU-") else (),
                                 f"/dev/nvidia{minor}" if minor.isdigit() else None))
    return sorted(devices, key=lambda d: d.bus), "/proc/driver/nvidia/gpus"


def _kfd(root: Path) -> tuple[list[GpuDevice], str]:
    base = root / "sys/class/kfd/kfd/topology/nodes"
    devices = []
    nodes = sorted((p for p in base.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    for node in nodes:
        props = {}
        for line in (_read(node / "properties") or "").splitlines():
            key, _, value = line.partition(" ")
            props[key] = value.strip()
        if not props.get("simd_count", "0").isdigit() or int(props.get("simd_count", "0")) == 0:
            continue  # a CPU node
        location, domain = int(props.get("location_id", "0")), int(props.get("domain", "0"))
        bus = f"{domain:04x}:{location >> 8:02x}:{(location >> 3) & 0x1F:02x}.{location & 7}"
        unique = props.get("unique_id", "")
        minor = props.get("drm_render_minor", "")
        devices.append(GpuDevice(bus, (f"GPU-{int(unique):016x}",) if unique.isdigit() and int(unique) else (),
                                 f"/dev/dri/renderD{minor}" if minor.isdigit() else None))
    return devices, "/sys/class/kfd topology"


def _pci(root: Path, vendor: str) -> tuple[list[GpuDevice], str]:
    base = root / "sys/bus/pci/devices"
    devices = []
    for dev in sorted(base.glob("*")):
        if (_read(dev / "vendor") or "").strip().lower() != PCI_VENDORS[vendor]:
            continue
        if not (_read(dev / "class") or "").strip().lower().startswith("0x03"):
            continue  # not a display/3D controller
        driver = dev / "driver"
        if driver.is_symlink() and os.path.basename(os.readlink(driver)) not in DRIVERS[vendor]:
            continue  # e.g. a BMC's VGA, or a GPU bound to vfio for a VM
        render = sorted((dev / "drm").glob("renderD*")) if (dev / "drm").is_dir() else []
        devices.append(GpuDevice(dev.name.lower(), (), f"/dev/dri/{render[0].name}" if render else None))
    return devices, "/sys/bus/pci"


def device_for(vendor: str, gpu_id: str, devices: Sequence[GpuDevice]) -> GpuDevice | None:
    """The device a job GPU id names: a position in the runtime's order, a UUID (or CUDA's unique prefix of
    one), a MIG instance (its GPU), an Intel tile (its device)."""
    key = gpus.device_of(vendor, gpu_id)
    if key.isdigit():
        return devices[int(key)] if int(key) < len(devices) else None
    if key.startswith("MIG-GPU-"):  # CUDA 11's MIG-GPU-<uuid>/<gi>/<ci>
        key = key[4:].split("/")[0]
    matches = [d for d in devices if any(u == key for u in d.uuids)] or \
        [d for d in devices if any(u.startswith(key) for u in d.uuids)]
    return matches[0] if len(matches) == 1 else None


def allowed_cpus(env: Mapping[str, str]) -> frozenset[int]:
    """The CPUs this process may run on (a fake tree's /proc/self/status where one is given)."""
    root = _root(env)
    if root != Path("/"):
        text = _read(root / "proc/self/status") or ""
        if m := re.search(r"^Cpus_allowed_list:\s*(\S+)", text, re.M):
            return gpus.parse_cpulist(m.group(1))
    return frozenset(os.sched_getaffinity(0))


def node_topology(vendor: str, ids: Sequence[str], env: Mapping[str, str]) -> gpus.Topology:
    """This node's topology for the job GPU ids `ids` (what `core.gpus.bind` needs)."""
    root = _root(env)
    allowed = allowed_cpus(env)
    siblings: dict[int, frozenset[int]] = {}
    for cpu in allowed:
        text = _read(root / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if text and text.strip():
            try:
                siblings[cpu] = gpus.parse_cpulist(text)
            except ValueError:
                pass
    if not ids:
        return gpus.Topology(allowed=allowed, siblings=siblings)
    devices, source = gpu_devices(vendor, env, mig=any(i.startswith("MIG-") for i in ids))
    local: dict[str, frozenset[int]] = {}
    buses: dict[str, str] = {}
    unknown: list[str] = []
    for gpu_id in ids:
        device = device_for(vendor, gpu_id, devices)
        if device is None:
            unknown.append(source if not devices else f"{gpu_id} is not one of the {len(devices)} GPUs {source} shows")
            continue
        buses[gpu_id] = device.bus
        text = _read(root / "sys/bus/pci/devices" / device.bus / "local_cpulist")
        try:
            cpus = gpus.parse_cpulist(text) if text and text.strip() else frozenset()
        except ValueError:
            cpus = frozenset()
        if cpus:
            local[gpu_id] = cpus
        else:
            unknown.append(f"no local_cpulist for {device.bus}")
    return gpus.Topology(allowed=allowed, local=local, siblings=siblings, buses=buses,
                         unknown="; ".join(dict.fromkeys(unknown)))


def worker_gpu_ids(vendor: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """The GPU ids a worker's environment pins it to (none when hidden)."""
    value = gpus.pinned(vendor, env)
    return tuple(x for x in (value or "").split(",") if x)


def bind_here(workers: list[WorkerSpec], node: int, vendor: str,
              env: Mapping[str, str]) -> tuple[list[WorkerSpec], list[str]]:
    """`workers` with those of node `node` (this one) bound to cores of this machine; notes in words.

    Each worker's GPUs are the ids its `env` pins (set on this node already)."""
    mine = [w for w in workers if w.node == node]
    ids = {w.name: worker_gpu_ids(vendor, w.env) for w in mine}
    topology = node_topology(vendor, sorted({g for v in ids.values() for g in v}), env)
    return bind_node(workers, node, ids, topology)


def bound_layout(layout_: Layout, env: Mapping[str, str], node: int = 0) -> Layout:
    """The layout with node `node`'s workers bound as they would be on this machine (`show` inside a job, or
    of a node described by $HPC_GARAGE_SYSFS_ROOT); unchanged where the site turns binding off."""
    if not layout_.site.workers.bind_cpus:
        return layout_
    vendor = layout_.site.node.gpu_vendor
    workers, notes = bind_here(layout_.workers, node, vendor, env)
    if len(layout_.allocation.nodes) > 1:
        notes.append("the other nodes bind their workers as they start, to the cores each node shows")
    allocation = replace(layout_.allocation, notes=(*layout_.allocation.notes, *(f"node {node}: {n}" for n in notes)))
    return replace(layout_, allocation=allocation, workers=workers)
