"""Writes the fake sysfs trees next to this file (run it after changing it; the trees are committed).

Each tree is what `HPC_GARAGE_SYSFS_ROOT` points at: `sys/bus/pci/devices/<bus>/{vendor,class,local_cpulist,
numa_node}`, NVIDIA's `proc/driver/nvidia/gpus/<bus>/information`, AMD's KFD topology, and
`proc/self/status` (the CPUs the job may use) where the tree describes a whole node.

- nvidia-2socket, amd-2socket, intel-2socket: the issue's node: 64 cores, NUMA 0 = CPUs 0-31 with GPUs 0-3,
  NUMA 1 = CPUs 32-63 with GPUs 4-7 (in each vendor's order), plus a NIC and a BMC's VGA that are not GPUs.
- lab: four NVIDIA GPUs on this 2-CPU test machine, crossed: GPUs 0 and 2 next to CPU 1, GPUs 1 and 3 next
  to CPU 0; no proc/self/status, so the real sched_getaffinity applies (the local SLURM's job test).
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUSES = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
         "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]
NUMA = {0: "0-31", 1: "32-63"}
KFD_ORDER = [1, 0, 3, 2, 5, 4, 7, 6]  # ROCr's order is the KFD topology's, not the PCI bus order
EXTRA = [("0000:17:00.0", "0x15b3", "0x020700", "0-31", 0),   # a NIC
         ("0000:03:00.0", "0x1a03", "0x030000", "0-63", -1)]  # the BMC's VGA (ASPEED): a display device, no GPU


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pci(root: Path, bus: str, vendor: str, cls: str, cpus: str, numa: int) -> None:
    base = root / "sys/bus/pci/devices" / bus
    write(base / "vendor", f"{vendor}\n")
    write(base / "class", f"{cls}\n")
    write(base / "local_cpulist", f"{cpus}\n")
    write(base / "numa_node", f"{numa}\n")


def node(root: Path, vendor: str, cls: str, locality: list[str], allowed: str | None = "0-63") -> None:
    shutil.rmtree(root, ignore_errors=True)
    for bus, v, c, cpus, numa in EXTRA:
        pci(root, bus, v, c, cpus, numa)
    for k, bus in enumerate(BUSES[:len(locality)]):
        pci(root, bus, vendor, cls, locality[k], 0 if locality[k] == NUMA[0] else 1)
    if allowed:
        write(root / "proc/self/status", f"Name:\tpython3\nCpus_allowed_list:\t{allowed}\n")


def nvidia(root: Path, locality: list[str], allowed: str | None = "0-63") -> None:
    node(root, "0x10de", "0x030200", locality, allowed)
    for k, bus in enumerate(BUSES[:len(locality)]):
        write(root / "proc/driver/nvidia/gpus" / bus / "information",
              f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t GPU-{k:08x}-1111-2222-3333-44445555666{k}\n"
              f"Video BIOS: \t 96.00.30.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDevice Minor: \t {k}\n"
              f"Bus Location: \t {bus}\n")


def amd(root: Path) -> None:
    locality = [NUMA[0]] * 4 + [NUMA[1]] * 4
    node(root, "0x1002", "0x038000", locality)
    kfd = root / "sys/class/kfd/kfd/topology/nodes"
    for n in range(2):  # the two CPU sockets come first in the KFD topology
        write(kfd / str(n) / "properties", f"cpu_cores_count 32\nsimd_count 0\nlocation_id 0\ndomain 0\n")
    for k, bus in enumerate(BUSES[i] for i in KFD_ORDER):
        domain, rest = bus.split(":", 1)
        b, dev_fn = rest.split(":")
        d, f = dev_fn.split(".")
        location = int(b, 16) << 8 | int(d, 16) << 3 | int(f)
        write(kfd / str(k + 2) / "properties",
              f"cpu_cores_count 0\nsimd_count 440\nlocation_id {location}\ndomain {int(domain, 16)}\n"
              f"drm_render_minor {128 + k}\nunique_id {0xA5A5000000000000 + k}\n")


def main() -> None:
    two_socket = [NUMA[0]] * 4 + [NUMA[1]] * 4
    nvidia(HERE / "nvidia-2socket", two_socket)
    amd(HERE / "amd-2socket")
    node(HERE / "intel-2socket", "0x8086", "0x038000", two_socket)
    nvidia(HERE / "lab", ["1", "0", "1", "0"], allowed=None)


if __name__ == "__main__":
    main()
