"""The doctor's container check: the runtime is here, the image is there, and hpc-garage inside it is this one.

A job on a container site runs `run` inside the image (schedulers/container.py), so an image without
hpc-garage, or with another version of it, fails only once the job starts: asked here, on the login node,
by running the image's interpreter the way the job will (same runtime line, same binds).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from hpc_garage._version import __version__
from hpc_garage.core.container import wrap
from hpc_garage.doctor.checks import Check, site_file
from hpc_garage.doctor.probe import VERSIONS_CODE
from hpc_garage.variables import CONTAINER_ENV

if TYPE_CHECKING:
    from hpc_garage.core.site import Site

NAME = "container"


def container_check(site: Site, env: Mapping[str, str],
                    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> Check | None:
    """One line: the runtime, the image and hpc-garage's version inside it (a missing runtime is a UserError
    from `resolve_runtime`, which `guarded` turns into the failure line naming it)."""
    if site.container is None:
        return None
    from hpc_garage.schedulers.container import launch_for, resolve_runtime, runtime_env

    container = site.container
    runtime = resolve_runtime(site, {k: v for k, v in env.items() if k != CONTAINER_ENV})  # as on the host
    if runtime == "pyxis":  # an srun step: only inside an allocation
        return Check.note(NAME, f"pyxis image {container.image}: checked from a compute node by `doctor --job`")
    if runtime == "podman":
        present = run(["podman", "image", "exists", container.image], capture_output=True, text=True, timeout=60)
        if present.returncode != 0:
            return Check.fail(NAME, f"podman has no image {container.image!r} here",
                              f"build or load it (`podman load -i FILE`, `podman pull`), or fix container.image in "
                              f"{site_file(site)}")
    line = wrap(runtime, launch_for(site, runtime, env), [container.python, "-c", VERSIONS_CODE])
    try:
        done = run(line, capture_output=True, text=True, timeout=300, env={**env, **runtime_env(runtime, env)})
    except subprocess.TimeoutExpired:
        return Check.fail(NAME, f"{runtime} did not start {container.python} in {container.image} within 300 s")
    where = f"{runtime} image {container.image}"
    lines = done.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        if "No module named" in said and "hpc_garage" in said:
            return Check.fail(NAME, f"{where} has no hpc-garage ({said})",
                              f"install hpc-garage=={__version__} in the image (docs/how-to/containers.md)")
        return Check.fail(NAME, f"{where}: {container.python} does not run there ({said})",
                          f"check container.image and container.python in {site_file(site)}")
    inside = found.get("hpc-garage")
    if inside != __version__:
        return Check.fail(NAME, f"{where} has hpc-garage {inside}, and this one is {__version__}",
                          f"install hpc-garage=={__version__} in the image, or run this version's image")
    others = ", ".join(f"{pkg} {found.get(pkg)}" for pkg in found if pkg != "hpc-garage")
    return Check(NAME, f"{where}: hpc-garage {inside} inside, as here ({others})")
