"""A site's container on this machine: which runtime, what is bound, and the words before each `python`.

`run` itself runs inside the image (`enter`: it re-executes itself there before it starts anything), because
Dask's scheduler, which lives in `run`'s process, unpickles the task graph and so needs every module the
tasks name: the image's, not the host's. What `run` then starts on other nodes through the batch system
(the mpi launcher's node processes, the dask-mpi ranks, the jobqueue worker jobs) is started on the host by
srun/mpiexec/sbatch, so it is wrapped again (`python_argv`). The runtime is resolved once, on the host, and
handed down in $HPC_GARAGE_CONTAINER, which also tells a process that it already runs inside.
"""

from __future__ import annotations

import logging
import os
import pwd
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_garage.core.container import COMMANDS, RUNTIMES, Launch, passed_names, wrap
from hpc_garage.core.errors import UserError
from hpc_garage.files import expand_path
from hpc_garage.sweeps import results_root
from hpc_garage.variables import CONTAINER_ENV

if TYPE_CHECKING:
    from hpc_garage.core.site import Site

logger = logging.getLogger(__name__)


def resolve_runtime(site: Site, env: Mapping[str, str] | None = None) -> str:
    """The runtime this job uses: the one handed down, the site's, or (`auto`) the first this node has."""
    env = os.environ if env is None else env
    assert site.container is not None
    if env.get(CONTAINER_ENV) in RUNTIMES:
        return str(env[CONTAINER_ENV])
    wanted = site.container.runtime
    if wanted != "auto":
        if shutil.which(COMMANDS[wanted]) is None:
            raise UserError(f"{site.path or site.name}: container.runtime: {wanted}, but `{COMMANDS[wanted]}` is "
                            "not on PATH here; load its module in the site's setup, or pick the runtime this node has")
        return wanted
    if found := on_path():
        return found[0]
    raise UserError(f"{site.path or site.name}: container.runtime: auto, but none of "
                    f"{', '.join(COMMANDS[r] for r in RUNTIMES if r != 'pyxis')} is on PATH here; install one, or "
                    "name the runtime (pyxis is never guessed: it is srun's)")


def on_path() -> list[str]:
    """The runtimes this node has, in the order `auto` tries them (pyxis is srun's: never guessed)."""
    return [r for r in RUNTIMES if r != "pyxis" and shutil.which(COMMANDS[r])]


def binds(site: Site, cwd: str | None = None, env: Mapping[str, str] | None = None, *,
          make: bool = True) -> tuple[str, ...]:
    """What hpc-garage binds, at the same path inside: the run root (TLS files, the scheduler file, logs), the
    sweeps' results, the working directory, the site file's folder and HOME; then the site's own binds."""
    env = os.environ if env is None else env
    made = [expand_path(site.run_directory), results_root(site.results_directory, site.run_directory)]
    for path in made if make else ():  # a bind's source must exist; these two are created by `run` anyway
        path.mkdir(parents=True, exist_ok=True)
    ours = [*made, Path(cwd or os.getcwd())]
    if site.path is not None:
        ours.append(Path(site.path).resolve().parent)
    if env.get("HOME"):
        ours.append(Path(env["HOME"]))
    assert site.container is not None
    theirs = [os.path.expandvars(os.path.expanduser(b)) for b in site.container.binds]
    paths = [str(p) for p in ours] + [b for b in theirs if ":" not in b]
    return (*_one_per_tree(paths), *(b for b in theirs if ":" in b))


def _one_per_tree(paths: Sequence[str]) -> list[str]:
    """Each path once, and none inside another one: a bind at the same path covers what is below it."""
    return [path for i, path in enumerate(paths) if path not in paths[:i]
            and not any(other != path and path.startswith(other.rstrip("/") + "/") for other in paths)]


HOST_TMP = "/tmp"  # ch-run mounts the host's /tmp there: a path under it needs no mount point in the image


def onto_mount_points(image: str, bound: Sequence[str], origin: str) -> tuple[str, ...]:
    """Charliecloud binds only onto a directory the image has: ch-run cannot create one in a read-only image
    ("can't mkdir ...: Read-only file system"), and an image rarely has the user's HOME (/home/alice) or a
    site's scratch. A path a directory image lacks is bound through its deepest ancestor that the image has
    as an empty directory, a mount point (/home/alice through /home), at the same path. Where there is none
    (or it holds the image's own files, which the bind would hide): one line naming the mount point to make.
    An image file (squashfs) cannot be read from here: its binds are left as they are."""
    root = Path(image)
    if not root.is_dir():
        return tuple(bound)
    kept: list[str] = []
    for bind in bound:
        src, _, dst = bind.partition(":")
        dst = dst or src
        if dst == HOST_TMP or dst.startswith(HOST_TMP + "/") or (root / dst.lstrip("/")).is_dir():
            kept.append(bind)
            continue
        ancestor = Path(dst).parent
        while ancestor.parent != ancestor and not (root / str(ancestor).lstrip("/")).exists():
            ancestor = ancestor.parent
        inside = root / str(ancestor).lstrip("/")
        if ancestor.parent == ancestor or src != dst or not inside.is_dir() or any(inside.iterdir()):
            top = Path(dst).parents[-2] if len(Path(dst).parts) > 2 else Path(dst)
            raise UserError(f"{origin}: the image {image} has no {dst} to bind {src} onto, and ch-run cannot make "
                            f"one in a read-only image; create the mount point in the image (mkdir -p "
                            f"{root / dst.lstrip('/')}, or `RUN mkdir -p {top}` in its recipe)")
        kept.append(str(ancestor))
    same = [b for b in kept if ":" not in b]  # several paths under one mount point: one bind
    return (*_one_per_tree(same), *(b for b in kept if ":" in b))


def launch_for(site: Site, runtime: str, env: Mapping[str, str] | None = None, cwd: str | None = None, *,
               make: bool = True) -> Launch:
    """The plain parameters of one process inside the site's image, as `core.container` spells them."""
    env = os.environ if env is None else env
    container = site.container
    assert container is not None
    gpus = site.node.gpu_vendor if container.gpus == "auto" and site.node.gpus else "none"
    image = os.path.expandvars(os.path.expanduser(container.image)) if container.image_is_path else container.image
    bound = binds(site, cwd, env, make=make)
    if runtime == "charliecloud":
        bound = onto_mount_points(image, bound, f"{site.path or site.name}: container.image")
    return Launch(image=image, binds=bound,
                  env={**site.env, **container.env}, passed=passed_names([*env, CONTAINER_ENV]), gpus=gpus,
                  workdir=cwd or os.getcwd())


def python_argv(site: Site, env: Mapping[str, str] | None = None) -> list[str]:
    """The interpreter a launcher starts on a node (before `-m ...`): the site's python, or inside its image."""
    if site.container is None:
        return [os.path.expanduser(site.python) if site.python else sys.executable]
    runtime = resolve_runtime(site, env)
    return wrap(runtime, launch_for(site, runtime, env), [site.container.python])


def runtime_env(runtime: str, env: Mapping[str, str]) -> dict[str, str]:
    """What the runtime itself needs in its environment and `env` lacks: ch-run refuses to start without $USER
    ("$USER not set"), which a job submitted by a service (a Prefect worker under systemd) may not have."""
    if runtime == "charliecloud" and not env.get("USER"):
        return {"USER": pwd.getpwuid(os.getuid()).pw_name}
    return {}


def enter(site: Site, argv: Sequence[str]) -> None:
    """Re-execute this `hpc-garage` command inside the site's image; once there, put the image's interpreter
    first on PATH, so that COMMAND's `python` is the image's (the host's may be visible through a bind)."""
    if site.container is None:
        return
    if os.environ.get(CONTAINER_ENV):
        here = os.path.dirname(sys.executable)
        os.environ["PATH"] = os.pathsep.join([here, *(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                                       if p and p != here)])
        return
    runtime = resolve_runtime(site)
    os.environ[CONTAINER_ENV] = runtime
    os.environ.update(runtime_env(runtime, os.environ))
    line = wrap(runtime, launch_for(site, runtime), [site.container.python, "-m", "hpc_garage", *argv])
    logger.info("entering the container: %s", " ".join(line))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(line[0], line)


def entry_line(site: Site, workdir: str) -> str:
    """The line `run` enters the image with inside a job started in `workdir`, for the job script's comment:
    the runtime this machine has where the site says `auto` (the node resolves it again). Writes nothing."""
    assert site.container is not None
    runtime = site.container.runtime
    if runtime == "auto":
        runtime = (on_path() or ["apptainer"])[0]
    env = {"HOME": os.environ.get("HOME", "~"), CONTAINER_ENV: runtime}
    line = wrap(runtime, launch_for(site, runtime, env, workdir, make=False),
                [site.container.python, "-m", "hpc_garage", "run", "..."])
    return shlex.join(line)
