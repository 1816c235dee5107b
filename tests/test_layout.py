"""layout(site, allocation): the worker processes and their per-process resources."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_garage.core.allocation import Allocation, NodeAllocation
from hpc_garage.core.errors import LayoutError
from hpc_garage.core.layout import describe, layout, pin_gpus
from hpc_garage.core.site import Site, parse_site_dict

GIB = 2**30


def site(per: str = "gpu", cores: int = 32, memory: int = 256 * GIB, gpus: int = 4, **workers: Any) -> Site:
    return parse_site_dict(
        {
            "name": "t",
            "scheduler": "slurm",
            "node": {"cores": cores, "memory": f"{memory}B", "gpus": gpus},
            "workers": {"per": per, **workers},
        }
    )


def alloc(nodes: int = 1, cores: int = 32, memory: int = 256 * GIB, gpus: tuple[str, ...] = ("0", "1", "2", "3")) -> Allocation:
    return Allocation(nodes=tuple(NodeAllocation(cores, memory, gpus, f"h{i}") for i in range(nodes)), job_id="7")


@pytest.mark.parametrize("ngpus", [1, 2, 3, 4, 8])
def test_one_worker_per_gpu(ngpus: int) -> None:
    ids = tuple(str(i) for i in range(ngpus))
    workers = layout(site(gpus=8, cores=48), alloc(cores=48, gpus=ids)).workers
    assert len(workers) == ngpus
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == list(ids)
    assert all(w.resources["GPU"] == 1 and w.resources["CPU"] == 48 // ngpus for w in workers)
    assert all(w.env["OMP_NUM_THREADS"] == str(48 // ngpus) for w in workers)


def test_the_issue_example_numbers() -> None:
    workers = layout(site(reserve_memory="16GiB", threads=2), alloc()).workers
    w = workers[0]
    assert w.resources == {"GPU": 1, "CPU": 8, "MEMORY": 60 * GIB, "PROCESS": 1}
    assert w.nthreads == 2 and w.memory_limit == 60 * GIB
    assert w.resources_arg == f"GPU=1,CPU=8,MEMORY={60 * GIB},PROCESS=1"


def test_many_nodes_each_pinned_to_its_own_gpus() -> None:
    workers = layout(site(), alloc(nodes=3)).workers
    assert len(workers) == 12
    assert Counter(w.node for w in workers) == {0: 4, 1: 4, 2: 4}
    assert [w.host for w in workers[:4]] == ["h0"] * 4
    assert len({w.name for w in workers}) == 12


def test_uneven_cores_are_reported_not_lost() -> None:
    p = layout(site(cores=30), alloc(cores=30))
    assert all(w.resources["CPU"] == 7 for w in p.workers)
    assert any("2 of 30 cores unused" in x for x in p.leftovers)


def test_cpu_only_site_one_worker_per_node() -> None:
    workers = layout(site(per="node", gpus=0), alloc(nodes=2, gpus=())).workers
    assert len(workers) == 2
    assert "GPU" not in workers[0].resources and "CUDA_VISIBLE_DEVICES" not in workers[0].env
    assert workers[0].resources["CPU"] == 32 and workers[0].nthreads == 32


def test_processes_per_node_split_gpus_and_hide_them_from_workers_without() -> None:
    p = layout(site(per="process", processes=3), alloc(cores=32, gpus=("0", "1")))
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in p.workers] == ["", "", ""]
    assert any("2 of 2 GPUs unused" in x for x in p.leftovers)
    p2 = layout(site(per="process", processes=2), alloc(cores=32))
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in p2.workers] == ["0,1", "2,3"]
    assert [w.resources["GPU"] for w in p2.workers] == [2, 2]


def test_memory_reserve_comes_off_before_the_split() -> None:
    workers = layout(site(reserve_memory="16GiB"), alloc()).workers
    assert sum(w.memory_limit for w in workers) == 240 * GIB


def test_uuid_and_mig_ids_pinned_verbatim() -> None:
    ids = ("GPU-aa", "MIG-bb", "GPU-cc", "GPU-dd")
    workers = layout(site(), alloc(gpus=ids)).workers
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == list(ids)


def test_job_visible_ids_not_global_ones() -> None:
    # a job whose CUDA_VISIBLE_DEVICES is 2,3 pins to 2 and 3
    workers = layout(site(gpus=4), alloc(gpus=("2", "3"))).workers
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["2", "3"]


def vendor_site(vendor: str, gpus: int = 8, **workers: Any) -> Site:
    return parse_site_dict({"name": vendor, "scheduler": "slurm", "workers": {"per": "gpu", **workers},
                            "node": {"cores": 64, "memory": "512GiB", "gpus": gpus, "gpu_vendor": vendor}})


def test_amd_workers_set_rocr_to_their_gpu_and_the_later_stage_to_what_rocr_leaves() -> None:
    # ROCm applies ROCR_VISIBLE_DEVICES, then indexes HIP/CUDA_VISIBLE_DEVICES and GPU_DEVICE_ORDINAL into what
    # is left: the old rule (both = "5") left worker 5 asking for position 5 of a one-GPU list
    w = layout(vendor_site("amd"), alloc(cores=64, memory=512 * GIB, gpus=tuple(map(str, range(8))))).workers[5]
    assert w.env == {"OMP_NUM_THREADS": "8", "ROCR_VISIBLE_DEVICES": "5", "HIP_VISIBLE_DEVICES": "0",
                     "CUDA_VISIBLE_DEVICES": "0", "GPU_DEVICE_ORDINAL": "0"}


def test_intel_workers_get_ze_affinity_mask_and_tiles_verbatim() -> None:
    ids = ("0.0", "0.1", "1.0", "1.1")
    workers = layout(vendor_site("intel", gpus=4), alloc(cores=64, memory=512 * GIB, gpus=ids)).workers
    assert [w.env["ZE_AFFINITY_MASK"] for w in workers] == list(ids)
    assert all("CUDA_VISIBLE_DEVICES" not in w.env for w in workers)


def test_workers_without_gpus_on_a_gpu_node_are_hidden_per_vendor() -> None:
    a = alloc(cores=64, memory=512 * GIB, gpus=("0", "1"))
    hidden = {vendor: layout(vendor_site(vendor, per="process", processes=3), a).workers[0].env
              for vendor in ("nvidia", "amd", "intel")}
    assert hidden["nvidia"]["CUDA_VISIBLE_DEVICES"] == ""
    assert {hidden["amd"][v] for v in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                                       "GPU_DEVICE_ORDINAL")} == {"-1"}  # empty would mean "every GPU" to ROCr
    assert hidden["intel"]["ZE_AFFINITY_MASK"] == "-1"


def test_a_worker_never_gets_two_mig_instances() -> None:
    ids = ("MIG-aa", "MIG-bb", "MIG-cc", "MIG-dd")
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in layout(site(), alloc(gpus=ids)).workers] == list(ids)
    with pytest.raises(LayoutError, match="one MIG instance visible to a process"):
        layout(site(per="process", processes=2), alloc(gpus=ids)).workers


def test_pin_gpus_maps_slots_onto_the_nodes_own_ids() -> None:
    w = layout(site(), alloc(gpus=("0", "1"))).workers[1]
    assert pin_gpus(w, ["2", "3"], "nvidia") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert pin_gpus(w, ["2", "3"], ("CUDA_VISIBLE_DEVICES",)) == {"CUDA_VISIBLE_DEVICES": "3"}  # older callers
    assert pin_gpus(w, ["2", "3"], "amd") == {"ROCR_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "0",
                                              "CUDA_VISIBLE_DEVICES": "0", "GPU_DEVICE_ORDINAL": "0"}
    assert pin_gpus(w, ["2", "3"], ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"))["HIP_VISIBLE_DEVICES"] == "0"
    with pytest.raises(LayoutError, match="slot 1"):
        pin_gpus(w, ["0"], "nvidia")


def test_describe_names_each_vendors_variable_and_the_binding() -> None:
    a = alloc(cores=64, memory=512 * GIB, gpus=tuple(map(str, range(8))))
    amd = "\n".join(describe(layout(vendor_site("amd"), a)))
    assert "ROCR_VISIBLE_DEVICES 0..7 (then HIP_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES, GPU_DEVICE_ORDINAL 0)" in amd
    assert "ZE_AFFINITY_MASK 0..7" in "\n".join(describe(layout(vendor_site("intel"), a)))
    assert "binds to its CPU share" in amd
    assert "binds" not in "\n".join(describe(layout(vendor_site("amd", bind_cpus=False), a)))


@pytest.mark.parametrize(
    "s, a, message",
    [
        (site(), alloc(gpus=()), "no GPUs"),
        (site(reserve_memory="8GiB"), alloc(memory=8 * GIB), "reserves"),
        (site(threads=16), alloc(), "workers.threads"),
        (site(per="process", processes=8), alloc(cores=4), "fewer than the 8 workers"),
    ],
)
def test_refusals_say_why(s: Site, a: Allocation, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        layout(s, a).workers


# ------------------------------------------------------------------------------------------ properties


@st.composite
def cases(draw: st.DrawFn) -> tuple[Site, Allocation]:
    per = draw(st.sampled_from(["gpu", "node", "process"]))
    ngpus = draw(st.integers(1 if per == "gpu" else 0, 8))
    processes = draw(st.integers(1, 6))
    cores = draw(st.integers(max(ngpus, processes, 1), 256))
    memory = draw(st.integers(GIB, 2048 * GIB))
    reserve = draw(st.integers(0, memory // 2))
    nodes = draw(st.integers(1, 6))
    uuids = draw(st.booleans())
    ids = tuple(f"GPU-{i:04x}" if uuids else str(i) for i in range(ngpus))
    s = parse_site_dict({"name": "p", "scheduler": "slurm",
                         "node": {"cores": cores, "memory": f"{memory}B", "gpus": ngpus},
                         "workers": {"per": per, "reserve_memory": f"{reserve}B",
                                     **({"processes": processes} if per == "process" else {})}})
    a = Allocation(nodes=tuple(NodeAllocation(cores, memory, ids, f"n{i}") for i in range(nodes)))
    return s, a


@settings(max_examples=300, deadline=None)
@given(cases())
def test_invariants(case: tuple[Site, Allocation]) -> None:
    s, a = case
    workers = layout(s, a).workers
    for index, node in enumerate(a.nodes):
        mine = [w for w in workers if w.node == index]
        assert sum(w.resources["CPU"] for w in mine) <= node.cores
        assert sum(w.memory_limit for w in mine) <= node.memory - s.workers.reserve_memory
        used = [g for w in mine for g in w.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        assert len(used) == len(set(used))  # no GPU shared between processes
        assert set(used) <= set(node.gpus)
        if s.workers.per == "gpu":
            assert sorted(used) == sorted(node.gpus)  # every GPU used by exactly one worker
            assert all(w.resources["GPU"] == 1 for w in mine)
    for w in workers:
        assert w.resources["MEMORY"] == w.memory_limit
        assert 1 <= w.nthreads <= w.resources["CPU"]
        assert w.resources.get("GPU", 0) == len(w.gpu_slots)
        assert w.env["OMP_NUM_THREADS"] == str(w.resources["CPU"])


@settings(max_examples=200, deadline=None)
@given(cases(), st.one_of(st.none(), st.sampled_from(["7", "12.pbs-1", 'a"b%s\\é\u2028'])),
       st.lists(st.sampled_from([None, "h0", "gpu-01.cluster", 'odd"host']), min_size=6, max_size=6))
def test_to_json_is_the_compact_json_of_to_dict(case: tuple[Site, Allocation], job_id: str | None,
                                                hosts: list[str | None]) -> None:
    s, a = case
    a = replace(a, job_id=job_id, nodes=tuple(replace(n, host=h) for n, h in zip(a.nodes, hosts)))
    p = layout(s, a)
    assert p.to_json() == json.dumps(p.to_dict(), separators=(",", ":"))
    assert p.worker_count == len(p.workers)
    fewer = replace(p, workers=p.workers[1:])  # a Layout given its workers encodes those
    assert fewer.to_json() == json.dumps(fewer.to_dict(), separators=(",", ":"))
    assert fewer.worker_count == len(fewer.workers)


def test_nodes_of_different_shapes_in_one_plan() -> None:
    four, two = ("0", "1", "2", "3"), ("0", "1")
    a = Allocation(nodes=(NodeAllocation(32, 256 * GIB, four, "a"), NodeAllocation(32, 256 * GIB, two, "b"),
                          NodeAllocation(32, 256 * GIB, four, "c")), job_id="9")
    p = layout(site(), a)
    assert [w.name for w in p.workers] == ["9-n0-gpu0", "9-n0-gpu1", "9-n0-gpu2", "9-n0-gpu3", "9-n1-gpu0",
                                           "9-n1-gpu1", "9-n2-gpu0", "9-n2-gpu1", "9-n2-gpu2", "9-n2-gpu3"]
    assert [w.host for w in p.workers] == ["a"] * 4 + ["b"] * 2 + ["c"] * 4
    assert p.workers[4].resources["CPU"] == 16 and p.workers[0].resources["CPU"] == 8
    assert p.to_json() == json.dumps(p.to_dict(), separators=(",", ":"))


def test_workers_are_built_once_and_are_a_list() -> None:
    p = layout(site(), alloc(nodes=2))
    assert isinstance(p.workers, list) and p.workers is p.workers and len(p.workers) == 8
    assert p == layout(site(), alloc(nodes=2))
