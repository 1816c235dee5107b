"""core/container.py: each runtime's line, checked as text against its documented command line.

Documentation used (the lines for Apptainer, Singularity and Pyxis are checked against these only; Charliecloud's
`ch-run` 0.31 also for real, where tests/test_container_slurm.py runs):
- Apptainer `exec`: https://apptainer.org/docs/user/main/cli/apptainer_exec.html (`--nv`, `--rocm`,
  `-B/--bind src[:dest[:opts]]`, `--env`, `--pwd`; the host environment passes in unless `--cleanenv`)
- SingularityCE `exec`: https://docs.sylabs.io/guides/latest/user-guide/cli/singularity_exec.html (same options)
- Pyxis: https://github.com/NVIDIA/pyxis/wiki/Usage (`--container-image`, `--container-mounts=SRC:DST[,...]`,
  `--container-workdir`, `--no-container-mount-home`)
- Podman `run`: https://docs.podman.io/en/latest/markdown/podman-run.1.html (`--rm`, `--network host`,
  `--userns keep-id`, `--device nvidia.com/gpu=all` (CDI), `-v SRC:DST`, `--env NAME` / `--env NAME=VALUE`, `-w`)
- Charliecloud `ch-run`: https://hpc.github.io/charliecloud/ch-run.html (`-b/--bind=SRC[:DST]`,
  `--set-env=VAR=VALUE`, `-c/--cd=DIR`, `IMAGE -- CMD`)
"""

from __future__ import annotations

import pytest

from hpc_garage.core.container import Launch, passed_names, runtime_argv, wrap
from hpc_garage.core.errors import SiteError
from hpc_garage.core.site import parse_site_dict

LAUNCH = Launch(image="/img/t.sif", binds=("/runs", "/data:/mnt/data"), env={"A": "1"},
                passed=("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"), gpus="nvidia", workdir="/work")


@pytest.mark.parametrize("tool", ["apptainer", "singularity"])
def test_apptainer_and_singularity_lines(tool):
    assert runtime_argv(tool, LAUNCH) == [tool, "exec", "--nv", "--bind", "/runs:/runs", "--bind", "/data:/mnt/data",
                                          "--env", "A=1", "--pwd", "/work", "/img/t.sif"]
    amd = runtime_argv(tool, Launch(**{**LAUNCH.__dict__, "gpus": "amd"}))
    assert amd[2] == "--rocm" and "--nv" not in amd
    assert "--nv" not in runtime_argv(tool, Launch(**{**LAUNCH.__dict__, "gpus": "none"}))
    assert "--cleanenv" not in runtime_argv(tool, LAUNCH)  # the GPU mask and Dask's settings pass in


def test_pyxis_line_is_one_srun_step_with_the_container_options():
    line = wrap("pyxis", LAUNCH, ["python3", "-m", "x"])
    assert line[:5] == ["srun", "--ntasks=1", "--nodes=1", "--overlap", "--container-image=/img/t.sif"]
    assert "--container-mounts=/runs:/runs,/data:/mnt/data" in line
    assert "--container-workdir=/work" in line and "--no-container-mount-home" in line
    assert line[-5:] == ["env", "A=1", "python3", "-m", "x"]


def test_podman_passes_the_jobs_variables_by_name_and_the_gpus_through_cdi():
    line = runtime_argv("podman", LAUNCH)
    assert line[:3] == ["podman", "run", "--rm"]
    assert ["--network", "host"] == line[3:5] and "keep-id" in line
    assert line[line.index("--device") + 1] == "nvidia.com/gpu=all"
    assert ["-v", "/runs:/runs"] == line[line.index("-v"):line.index("-v") + 2]
    assert ["--env", "CUDA_VISIBLE_DEVICES", "--env", "OMP_NUM_THREADS", "--env", "A=1"] == \
        [w for i, w in enumerate(line) if w == "--env" or (i and line[i - 1] == "--env")]
    assert line[-3:] == ["-w", "/work", "/img/t.sif"]
    amd = runtime_argv("podman", Launch(**{**LAUNCH.__dict__, "gpus": "amd"}))
    assert ["--device", "/dev/kfd", "--device", "/dev/dri"] == amd[amd.index("--device"):amd.index("--device") + 4]


def test_charliecloud_line():
    assert wrap("charliecloud", LAUNCH, ["python3"]) == [
        "ch-run", "--bind=/runs:/runs", "--bind=/data:/mnt/data", "--set-env=A=1", "--cd=/work", "/img/t.sif", "--",
        "python3"]


def test_auto_must_be_resolved_first():
    with pytest.raises(ValueError, match="resolve `auto` first"):
        runtime_argv("auto", LAUNCH)


def test_passed_names_are_the_mask_threads_and_settings_only():
    names = ["CUDA_VISIBLE_DEVICES", "DASK_DISTRIBUTED__X", "HPC_GARAGE_SWEEP", "PATH", "SECRET", "OMP_NUM_THREADS"]
    assert passed_names(names) == ("CUDA_VISIBLE_DEVICES", "DASK_DISTRIBUTED__X", "HPC_GARAGE_SWEEP",
                                   "OMP_NUM_THREADS")


SITE = {"name": "c", "scheduler": "slurm", "node": {"cores": 8, "memory": "16GiB", "gpus": 4},
        "workers": {"per": "gpu"}}


@pytest.mark.parametrize(("container", "message"), [
    ({"runtime": "docker", "image": "x"}, "container.runtime: 'docker' is not allowed"),
    ({"runtime": "apptainer"}, "missing key 'container.image'"),
    ({"runtime": "charliecloud", "image": "/i"}, "container.gpus: auto cannot pass nvidia GPUs with runtime charliecloud"),
    ({"runtime": "apptainer", "image": "/i", "binds": ["a,b"]}, "container.binds: 'a,b' is not a bind"),
    ({"runtime": "apptainer", "image": "/i", "env": {"1X": "y"}}, "container.env: '1X' is not a variable name"),
])
def test_bad_container_settings_are_one_line_naming_the_key(container, message):
    with pytest.raises(SiteError) as info:
        parse_site_dict({**SITE, "container": container}, origin="f.yaml")
    text = str(info.value)
    assert text.startswith("f.yaml: ") and message in text and "\n" not in text


def test_pyxis_with_amd_gpus_is_refused_but_gpus_none_is_taken():
    amd = {**SITE, "node": {**SITE["node"], "gpu_vendor": "amd"}}
    with pytest.raises(SiteError, match="enroot's hooks pass NVIDIA GPUs only"):
        parse_site_dict({**amd, "container": {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch"}})
    site = parse_site_dict({**amd, "container": {"runtime": "pyxis", "image": "nvcr.io#x", "gpus": "none"}})
    assert site.container is not None and site.container.gpus == "none"
