"""Containers: a site's `container:` block, and the one place that spells each runtime's command line.

Every Python process a job starts (the `run` process that holds the scheduler and COMMAND, the mpi launcher's
node processes, the dask-mpi ranks, the jobqueue worker jobs) is started as `runtime_argv(...) + [python, ...]`,
so the runtimes differ here only: one small builder per runtime, from plain parameters, tested as text against
each runtime's documented options (tests/test_container.py names the pages). Pure: which paths exist and which
runtime a node has are asked by `sites/` and `doctor/`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RUNTIMES = ("apptainer", "singularity", "pyxis", "podman", "charliecloud")
# the command each runtime is found by (`auto`: the first of these a node has, in this order)
COMMANDS = {"apptainer": "apptainer", "singularity": "singularity", "pyxis": "srun", "podman": "podman",
            "charliecloud": "ch-run"}
# GPU vendors each runtime passes with `gpus: auto` (what it cannot pass is refused when the site is read)
GPU_VENDORS = {"apptainer": {"nvidia", "amd", "intel"}, "singularity": {"nvidia", "amd", "intel"},
               "pyxis": {"nvidia"}, "podman": {"nvidia", "amd", "intel"}, "charliecloud": set()}
# variables passed from the job into the container by name, where the runtime does not pass the environment:
# the GPU mask, the thread counts, Dask's and hpc-garage's settings, the Prefect API (prefixes end in _)
PASSED = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ZE_AFFINITY_MASK",
          "GPU_DEVICE_ORDINAL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
          "NUMEXPR_NUM_THREADS", "DASK_", "HPC_GARAGE_", "PREFECT_", "NO_PROXY", "no_proxy", "HOME", "USER",
          "PYTHONPATH")
_PATHLIKE = re.compile(r"^(/|~|\./|\.\./)|\.(sif|simg|sqsh|squashfs|img)$")


class ContainerSettings(BaseModel):
    """Run every Python process of the job inside an image: `runtime`, `image`, extra `binds` and `env`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    runtime: Literal["auto", "apptainer", "singularity", "pyxis", "podman", "charliecloud"] = "auto"  # auto: the first the node has (apptainer, singularity, pyxis, podman, charliecloud)
    image: str = Field(pattern=r"\S")  # a path (.sif, a directory, a squashfs file) or a reference, as the runtime spells it
    binds: list[str] = Field(default_factory=list)  # extra host paths (SRC or SRC:DST); hpc-garage binds the run and results directories, the working directory and HOME itself
    env: dict[str, str] = Field(default_factory=dict)  # set inside; the GPU mask, thread counts and Dask settings are passed by hpc-garage
    python: str = Field("python3", pattern=r"\S")  # the interpreter inside the image (hpc-garage installed in it)
    gpus: Literal["auto", "none"] = "auto"  # auto: the runtime's flags for node.gpu_vendor (--nv, --rocm, CDI devices); none: no flags (the GPU mask is still passed)

    @model_validator(mode="after")
    def _plain(self) -> ContainerSettings:
        for bind in self.binds:
            if not bind or bind.startswith(":") or "," in bind or "\0" in bind:
                raise ValueError(f"container.binds: {bind!r} is not a bind; write SRC or SRC:DST, one per item")
        for name, value in self.env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"container.env: {name!r} is not a variable name; use letters, digits and _")
            if "\0" in value:
                raise ValueError(f"container.env.{name}: the value holds a NUL byte; remove it")
        return self

    @property
    def image_is_path(self) -> bool:
        """Whether `image` names a file or directory (checked where the site is read), not a registry reference."""
        return self.runtime != "podman" and bool(_PATHLIKE.search(self.image))


def check_gpus(container: ContainerSettings, runtime: str, vendor: str, gpus: int) -> None:
    """`gpus: auto` on a GPU site whose runtime cannot pass that vendor's GPUs: ValueError naming the fix."""
    if container.gpus != "auto" or not gpus or runtime == "auto" or vendor in GPU_VENDORS[runtime]:
        return
    why = {"charliecloud": "ch-run has no GPU option (the driver's libraries go into the image with "
                           "`ch-fromhost --nvidia`)",
           "pyxis": "enroot's hooks pass NVIDIA GPUs only"}.get(runtime, f"it has no option for {vendor} GPUs")
    raise ValueError(f"container.gpus: auto cannot pass {vendor} GPUs with runtime {runtime}: {why}; set "
                     "container.gpus: none (the GPU mask is still passed) or use another runtime")


@dataclass(frozen=True)
class Launch:
    """What one process needs from the runtime: the image, what is bound, what is set, where it starts."""

    image: str
    binds: tuple[str, ...]  # SRC or SRC:DST, hpc-garage's first, then the site's
    env: Mapping[str, str]  # set inside (the site's, then what hpc-garage sets)
    passed: tuple[str, ...]  # names of the job's variables handed in (the GPU mask, threads, Dask's settings)
    gpus: str  # "none" or the vendor: nvidia | amd | intel
    workdir: str | None = None


def _pairs(binds: Sequence[str]) -> list[tuple[str, str]]:
    return [(b.split(":", 2)[0], b.split(":", 2)[1] if ":" in b else b.split(":", 2)[0]) for b in binds]


def _apptainer(tool: str) -> Callable[[Launch], list[str]]:
    """`apptainer|singularity exec [--nv|--rocm] [--bind SRC:DST] [--env K=V] [--pwd DIR] IMAGE`: the job's
    environment passes in by default (no --cleanenv), so only the site's own `env` is spelled."""

    def line(launch: Launch) -> list[str]:
        argv = [tool, "exec"]
        argv += {"nvidia": ["--nv"], "amd": ["--rocm"]}.get(launch.gpus, [])
        for src, dst in _pairs(launch.binds):
            argv += ["--bind", f"{src}:{dst}"]
        for name, value in launch.env.items():
            argv += ["--env", f"{name}={value}"]
        if launch.workdir:
            argv += ["--pwd", launch.workdir]
        return [*argv, launch.image]

    return line


def _pyxis(launch: Launch) -> list[str]:
    """`srun --ntasks=1 --container-image=IMAGE --container-mounts=SRC:DST,... --container-workdir=DIR`: a job
    step of one task on this node; the job's environment passes in (srun's default), enroot's hooks give the
    NVIDIA GPUs; `env` is set through `env` inside, since pyxis has no option to set a value."""
    argv = ["srun", "--ntasks=1", "--nodes=1", "--overlap", f"--container-image={launch.image}"]
    if launch.binds:
        argv.append("--container-mounts=" + ",".join(f"{s}:{d}" for s, d in _pairs(launch.binds)))
    if launch.workdir:
        argv.append(f"--container-workdir={launch.workdir}")
    argv.append("--no-container-mount-home")  # HOME is among hpc-garage's binds, at its own path
    if launch.env:
        argv += ["env", *(f"{k}={v}" for k, v in launch.env.items())]
    return argv


def _podman(launch: Launch) -> list[str]:
    """`podman run --rm --network host --userns keep-id [--device ...] -v SRC:DST --env K=V [--env NAME] -w DIR
    IMAGE`: podman passes no variable unless named, so the job's are handed in by name (`--env NAME`)."""
    argv = ["podman", "run", "--rm", "--network", "host", "--pid", "host", "--ipc", "host", "--userns", "keep-id",
            "--security-opt", "label=disable"]
    argv += {"nvidia": ["--device", "nvidia.com/gpu=all"], "amd": ["--device", "/dev/kfd", "--device", "/dev/dri"],
             "intel": ["--device", "/dev/dri"]}.get(launch.gpus, [])
    for src, dst in _pairs(launch.binds):
        argv += ["-v", f"{src}:{dst}"]
    for name in launch.passed:
        argv += ["--env", name]
    for name, value in launch.env.items():
        argv += ["--env", f"{name}={value}"]
    if launch.workdir:
        argv += ["-w", launch.workdir]
    return [*argv, launch.image]


def _charliecloud(launch: Launch) -> list[str]:
    """`ch-run -b SRC:DST --set-env=K=V -c DIR IMAGE --`: the job's environment passes in (ch-run's default);
    GPUs are the host's devices, their libraries put into the image beforehand (`ch-fromhost`)."""
    argv = ["ch-run"]
    for src, dst in _pairs(launch.binds):
        argv.append(f"--bind={src}:{dst}")
    for name, value in launch.env.items():
        argv.append(f"--set-env={name}={value}")
    if launch.workdir:
        argv.append(f"--cd={launch.workdir}")
    return [*argv, launch.image, "--"]


BUILDERS: dict[str, Callable[[Launch], list[str]]] = {
    "apptainer": _apptainer("apptainer"), "singularity": _apptainer("singularity"), "pyxis": _pyxis,
    "podman": _podman, "charliecloud": _charliecloud}


def passed_names(environ_names: Sequence[str]) -> tuple[str, ...]:
    """The job's variables handed into a runtime that passes none by itself (PASSED: names and prefixes)."""
    return tuple(sorted(n for n in environ_names
                        if any(n == p or (p.endswith("_") and n.startswith(p)) for p in PASSED)))


def runtime_argv(runtime: str, launch: Launch) -> list[str]:
    """The words that go before `python ...` to run it inside the image (`runtime` already resolved)."""
    if runtime not in BUILDERS:
        raise ValueError(f"container runtime {runtime!r}: resolve `auto` first (one of {', '.join(RUNTIMES)})")
    return BUILDERS[runtime](launch)


def wrap(runtime: str, launch: Launch, argv: Sequence[str]) -> list[str]:
    """`argv` run inside the image."""
    return [*runtime_argv(runtime, launch), *argv]
