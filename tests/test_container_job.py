"""schedulers/container.py and the job script: a site's container on disk, in `show --script`, in the launchers."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from hpc_garage.core.errors import SiteError, UserError
from hpc_garage.schedulers import container as job_container
from hpc_garage.sites import parse_site_file, with_container


def _site(tmp_path: Path, container: str, gpus: int = 2) -> Path:
    path = tmp_path / "c.yaml"
    per = "gpu" if gpus else "node"
    path.write_text(f"scheduler: slurm\nnode: {{cores: 4, memory: 8GiB, gpus: {gpus}}}\nworkers: {{per: {per}}}\n"
                    f"run_directory: {tmp_path}/runs\ncontainer: {container}\n")
    return path


def test_a_missing_image_path_and_a_missing_bind_are_refused_naming_file_and_key(tmp_path):
    with pytest.raises(SiteError, match=r"c\.yaml: container\.image: '/no/such\.sif' does not exist"):
        parse_site_file(_site(tmp_path, "{runtime: apptainer, image: /no/such.sif}"))
    with pytest.raises(SiteError, match=r"c\.yaml: container\.binds: '/no/such/dir' does not exist"):
        parse_site_file(_site(tmp_path, f"{{runtime: apptainer, image: {tmp_path}, binds: [/no/such/dir]}}"))
    site = parse_site_file(_site(tmp_path, "{runtime: podman, image: localhost/garage}"))  # a reference: not a path
    assert site.container is not None and site.container.image == "localhost/garage"


def test_the_container_flag_replaces_the_image_and_is_checked(tmp_path):
    site = parse_site_file(_site(tmp_path, f"{{runtime: apptainer, image: {tmp_path}}}"))
    other = tmp_path / "other.sif"
    other.write_text("")
    moved = with_container(site, str(other))
    assert moved.container is not None and moved.container.image == str(other)
    assert moved.container.runtime == "apptainer" and moved.raw["container"]["image"] == str(other)
    with pytest.raises(SiteError, match="--container: container.image: '/gone.sif' does not exist"):
        with_container(site, "/gone.sif")


def test_the_job_script_shows_the_exact_entry_line_and_runs_command_with_the_images_python(tmp_path, monkeypatch):
    from hpc_garage.core.request import Request
    from hpc_garage.schedulers.submission import prepare

    image = tmp_path / "img"
    image.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    path = _site(tmp_path, f"{{runtime: apptainer, image: {image}, python: /opt/py/bin/python, env: {{K: v w}}}}")
    script = tmp_path / "sweep.py"
    script.write_text("")
    prepared = prepare(str(path), str(script), request=Request(container=str(image)), cwd=str(tmp_path))
    text = prepared.script
    line = next(l for l in text.splitlines() if l.startswith("#   apptainer"))
    argv = shlex.split(line[4:])
    assert argv[:3] == ["apptainer", "exec", "--nv"]
    assert f"{tmp_path}:{tmp_path}" in argv and ["--env", "K=v w"] == argv[argv.index("--env"):argv.index("--env") + 2]
    assert argv[argv.index(str(image)) + 1:] == ["/opt/py/bin/python", "-m", "hpc_garage", "run", "..."]
    last = text.rstrip().splitlines()[-1]
    assert f"--container {image} -- /opt/py/bin/python {script}" in last


def test_launchers_start_node_processes_inside_the_image(tmp_path, monkeypatch):
    image = tmp_path / "img"
    image.mkdir()
    site = parse_site_file(_site(tmp_path, f"{{runtime: charliecloud, image: {image}, gpus: none}}"))
    monkeypatch.setenv(job_container.CONTAINER_ENV, "charliecloud")  # handed down by `run`: no PATH lookup
    monkeypatch.setenv("HOME", str(tmp_path))  # every bind under /tmp, which ch-run takes from the host
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    argv = job_container.python_argv(site)
    assert argv[0] == "ch-run" and argv[-3:] == [str(image), "--", "python3"]
    assert f"--bind={tmp_path}:{tmp_path}" in argv  # the site's folder, which holds its run directory too


def test_a_runtime_missing_here_is_named(tmp_path, monkeypatch):
    image = tmp_path / "img"
    image.mkdir()
    site = parse_site_file(_site(tmp_path, f"{{runtime: apptainer, image: {image}}}"))
    monkeypatch.delenv(job_container.CONTAINER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(Exception, match="container.runtime: apptainer, but `apptainer` is not on PATH here"):
        job_container.resolve_runtime(site)
    auto = with_container(parse_site_file(_site(tmp_path, f"{{image: {image}}}", gpus=0)), str(image))
    with pytest.raises(Exception, match="container.runtime: auto, but none of apptainer, singularity, podman, ch-run"):
        job_container.resolve_runtime(auto)


def _image(tmp_path: Path, *dirs: str) -> Path:
    """A Charliecloud directory image with these directories (mount points, or holding a file where `+`)."""
    image = tmp_path / "img"
    for d in dirs:
        (image / d.strip("+/")).mkdir(parents=True, exist_ok=True)
        if d.endswith("+"):
            (image / d.strip("+/") / "file").write_text("the image's own")
    return image


def test_charliecloud_binds_a_path_the_image_lacks_through_its_empty_mount_point(tmp_path):
    """ch-run cannot make a mount point in a read-only image: HOME=/home/alice goes in through /home, a path
    under /tmp (the host's, in ch-run) and one the image has stay as they are, and nothing is bound twice."""
    image = _image(tmp_path, "home", "data/sets", "opt+")
    bound = job_container.onto_mount_points(
        str(image), ["/home/alice", "/home/bob/runs", "/tmp/x/y", "/data/sets", "/data/sets/a"], "s.yaml: container.image")
    assert bound == ("/home", "/tmp/x/y", "/data/sets")


@pytest.mark.parametrize(("bind", "why"), [
    ("/scratch/alice", "the image .* has no /scratch/alice to bind /scratch/alice onto"),  # no mount point at all
    ("/opt/runs", "the image .* has no /opt/runs"),  # /opt holds the image's files: a bind would hide them
    ("/home/alice:/users/alice", "no /users/alice to bind /home/alice onto"),  # the site's SRC:DST: not moved
])
def test_charliecloud_refuses_a_bind_it_cannot_mount_in_one_line_naming_the_fix(tmp_path, bind, why):
    image = _image(tmp_path, "home", "opt+")
    with pytest.raises(UserError, match=why) as caught:
        job_container.onto_mount_points(str(image), [bind], "s.yaml: container.image")
    message = str(caught.value)
    assert message.startswith("s.yaml: container.image: ") and "\n" not in message
    assert "mkdir -p" in message and "in its recipe" in message


def test_an_image_file_keeps_its_binds_as_they_are(tmp_path):
    squash = tmp_path / "img.sqfs"
    squash.write_text("")
    assert job_container.onto_mount_points(str(squash), ["/home/alice"], "o") == ("/home/alice",)


def test_a_charliecloud_site_binds_home_through_the_images_mount_point(tmp_path, monkeypatch):
    """Through the site: HOME=/home/alice-garage-test, which the image lacks, is bound at the image's /home."""
    image = _image(tmp_path, "home", "opt/python/bin")
    monkeypatch.setenv("HOME", "/home/alice-garage-test")
    site = parse_site_file(_site(tmp_path, f"{{runtime: charliecloud, image: {image}, gpus: none}}"))
    launch = job_container.launch_for(site, "charliecloud", cwd=str(tmp_path), make=False)
    assert launch.binds == (str(tmp_path), "/home"), launch.binds


def test_charliecloud_gets_user_where_the_environment_lacks_it():
    """ch-run will not start without $USER ("$USER not set"), which a job a service submitted may lack."""
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name
    assert job_container.runtime_env("charliecloud", {"HOME": "/h"}) == {"USER": me}
    assert job_container.runtime_env("charliecloud", {"USER": "alice"}) == {}
    assert job_container.runtime_env("apptainer", {}) == {}
