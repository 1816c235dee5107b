"""The real-GPU check (scripts/gpu-check): hpc-garage on a machine with NVIDIA GPUs, judged through NVML and CUDA.

Run by `bash scripts/gpu-check`; one line per check, `gpu-check: ok|FAIL|skip: ...`, exit 0 when every check
passed (or there is no GPU to check), 1 otherwise. Twice, a login-node sweep (`hpc-garage run --site <a site
with one worker per GPU> -- python <this file> sweep ...`) runs two trials per GPU; each trial asks the CUDA
driver (libcuda, through ctypes: no framework needed) what it sees, and NVML which device its mask names:
- pass 1 with the GPUs named by index (as a batch system sets CUDA_VISIBLE_DEVICES), pass 2 by UUID (as some
  sites and MIG do): each trial must see exactly one device, the one its mask names (UUID by NVML == UUID by
  CUDA), and no two trials running at the same time may share a GPU;
- each trial keeps its GPU busy (memsets) for a few seconds, and the run's report.json must carry per-trial GPU
  figures (utilisation and memory from the workers' NVML sampler) for every trial, with memory above zero.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY_SECONDS = 4.0
BUFFER_BYTES = 256 << 20


def line(status: str, text: str) -> None:
    print(f"gpu-check: {status}: {text}", flush=True)


# ------------------------------------------------------------------ what a trial sees (inside a worker)


def _cuda_uuid(raw: ctypes.Array) -> str:
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def trial_view(seconds: float) -> dict:
    """What this process sees: its mask, the CUDA driver's devices (count, UUIDs), NVML's device for the mask;
    then seconds of memsets on its one device, so the sampler has something to read."""
    import pynvml

    mask = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    view: dict = {"mask": mask, "pid": os.getpid(), "start": time.time()}
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        view["error"] = "cuInit failed"
        return view
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    view["cuda_count"] = count.value
    uuids = []
    for i in range(count.value):
        dev, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        cuda.cuDeviceGetUuid(raw, dev)
        uuids.append(_cuda_uuid(raw))
    view["cuda_uuids"] = uuids
    pynvml.nvmlInit()
    try:
        entry = mask.split(",")[0] if mask else ""
        handle = (pynvml.nvmlDeviceGetHandleByUUID(entry) if entry.startswith("GPU-")
                  else pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit() else None)
        if handle is not None:
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            view["nvml_uuid"] = uuid.decode() if isinstance(uuid, bytes) else uuid
            view["nvml_index"] = pynvml.nvmlDeviceGetIndex(handle)
    finally:
        pynvml.nvmlShutdown()
    if count.value >= 1:  # keep the device busy: a context, a buffer, memsets until the time is up
        dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        cuda.cuDeviceGet(ctypes.byref(dev), 0)
        cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
        cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(BUFFER_BYTES))
        end, n = time.time() + seconds, 0
        while time.time() < end:
            cuda.cuMemsetD8_v2(ptr, ctypes.c_ubyte(n % 256), ctypes.c_size_t(BUFFER_BYTES))
            cuda.cuCtxSynchronize()
            n += 1
        cuda.cuMemFree_v2(ptr)
        cuda.cuCtxDestroy_v2(ctx)
        view["memsets"] = n
    view["stop"] = time.time()
    return view


def sweep(trials: int, out: str) -> None:
    """The flow `hpc-garage run` runs: `trials` one-GPU trials; what each saw goes to `out` (JSON)."""
    from prefect import flow, task

    import hpc_garage

    @task(tags=hpc_garage.resources(gpu=1))
    def look(i: int) -> dict:
        return trial_view(BUSY_SECONDS)

    @flow(task_runner=hpc_garage.task_runner())
    def gpu_check_sweep() -> list[dict]:
        return [f.result() for f in [look.submit(i) for i in range(trials)]]

    Path(out).write_text(json.dumps(gpu_check_sweep()))


# ------------------------------------------------------------------ the checks (on the machine)


def machine_gpus() -> list[tuple[int, str]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            found.append((i, uuid.decode() if isinstance(uuid, bytes) else uuid))
        return found
    finally:
        pynvml.nvmlShutdown()


def judge(label: str, views: list[dict], expected: list[str]) -> bool:
    """Each trial saw one device, the one its mask names; concurrent trials never shared one; every GPU used."""
    ok = True
    for v in views:
        if v.get("error"):
            line("FAIL", f"{label}: trial pid {v.get('pid')}: {v['error']}")
            ok = False
        elif v.get("cuda_count") != 1:
            line("FAIL", f"{label}: a trial with CUDA_VISIBLE_DEVICES={v['mask']!r} saw {v.get('cuda_count')} "
                         f"devices through CUDA, not exactly 1")
            ok = False
        elif v["mask"] not in expected:
            line("FAIL", f"{label}: a trial's mask {v['mask']!r} is none of this machine's GPUs {expected}")
            ok = False
        elif v.get("nvml_uuid") != v["cuda_uuids"][0]:
            line("FAIL", f"{label}: mask {v['mask']!r}: NVML names {v.get('nvml_uuid')}, CUDA shows "
                         f"{v['cuda_uuids'][0]}")
            ok = False
    if ok:
        line("ok", f"{label}: {len(views)} trials each saw exactly its own GPU (CUDA's UUID = NVML's for its mask)")
    clashes = [(a["mask"], b["mask"]) for i, a in enumerate(views) for b in views[i + 1:]
               if a["mask"] == b["mask"] and a["start"] < b["stop"] and b["start"] < a["stop"]]
    if clashes:
        line("FAIL", f"{label}: {len(clashes)} pairs of trials ran on the same GPU at the same time: {clashes[:3]}")
        ok = False
    else:
        line("ok", f"{label}: no two trials shared a GPU at the same time")
    used = {v["mask"] for v in views}
    if used != set(expected):
        line("FAIL", f"{label}: GPUs used {sorted(used)}, expected all of {sorted(expected)}")
        ok = False
    else:
        line("ok", f"{label}: every GPU ran trials ({len(expected)} GPUs, {len(views)} trials)")
    return ok


def report_figures(label: str, runs: Path, trials: int) -> bool:
    reports = sorted(runs.glob("*/report.json"), key=lambda p: p.stat().st_mtime)
    if not reports:
        line("FAIL", f"{label}: no report.json under {runs}")
        return False
    report = json.loads(reports[-1].read_text())
    rows = report.get("trials", [])
    figured = [t for t in rows if "gpu_util_mean" in t and "gpu_memory_peak" in t]
    if len(rows) < trials or len(figured) < trials:
        line("FAIL", f"{label}: the report has GPU figures for {len(figured)} of {len(rows)} trials "
                     f"(expected {trials}); is nvidia-ml-py installed where the workers run?")
        return False
    if not all(t["gpu_memory_peak"] > 0 for t in figured):
        line("FAIL", f"{label}: a trial's GPU memory peak is 0: the sampler read no memory the trial held")
        return False
    line("ok", f"{label}: the report has NVML figures for all {trials} trials (utilisation peak "
               f"{max(t['gpu_util_peak'] for t in figured):.0f} %, memory peak "
               f"{max(t['gpu_memory_peak'] for t in figured) / 2**20:.0f} MiB)")
    return True


def one_pass(label: str, work: Path, gpus: list[str]) -> bool:
    runs = work / f"runs-{label}"
    site = work / f"gpu-check-{label}.yaml"  # found through HPC_GARAGE_SITES_PATH
    site.write_text(json.dumps({
        "description": "gpu-check: this machine, one worker per GPU", "scheduler": "local", "launcher": "mpi",
        "node": {"cores": "auto", "memory": "auto", "gpus": len(gpus)},
        "workers": {"per": "gpu", "reserve_memory": "1GiB"}, "run_directory": str(runs)}))
    out = work / f"views-{label}.json"
    trials = 2 * len(gpus)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus), "HPC_GARAGE_SITES_PATH": str(work)}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "hpc_garage", "run", "--site", site.stem, "--", sys.executable,
                           __file__, "sweep", str(trials), str(out)], env=env, capture_output=True, text=True,
                          timeout=150)
    if proc.returncode != 0 or not out.exists():
        line("FAIL", f"{label}: `hpc-garage run` exited {proc.returncode} after {time.time() - started:.0f} s; "
                     f"its last lines: {' | '.join(proc.stderr.strip().splitlines()[-5:])}")
        return False
    line("ok", f"{label}: a login-node sweep of {trials} one-GPU trials ran in {time.time() - started:.0f} s")
    views = json.loads(out.read_text())
    return judge(label, views, gpus) & report_figures(label, runs, trials)


def main() -> int:
    if not (Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists()):
        line("skip", "no NVIDIA GPU on this machine (no /dev/nvidia0): nothing to check")
        return 0
    try:
        import pynvml  # noqa: F401
    except ImportError:
        line("FAIL", "nvidia-ml-py is not installed: pip install 'hpc-garage[gpu]'")
        return 1
    found = machine_gpus()
    if not found:
        line("skip", "NVML finds no GPU on this machine: nothing to check")
        return 0
    line("ok", f"NVML: {len(found)} GPU(s): " + ", ".join(f"{i} {u}" for i, u in found))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        ok = one_pass("by-index", work, [str(i) for i, _ in found])
        ok &= one_pass("by-uuid", work, [u for _, u in found])
    line("ok" if ok else "FAIL", "all checks passed" if ok else "some checks failed")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["sweep"]:
        sweep(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit(main())
