"""Site files on disk: where they are looked for, and loading one into the core's `Site` model.

The model itself (`core.site`) is pure; this package is its I/O. `sites.view` loads plain sites for `show`
without importing pydantic.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpc_garage.sites import files as _files

if TYPE_CHECKING:
    from hpc_garage.core.site import Site


def search_path(env: dict[str, str] | None = None) -> list[Path]:
    """Where site files are looked for, first match wins (`files.search_path`, patchable here)."""
    return _files.search_path(env)


def find_sites() -> dict[str, Path]:
    """Every visible site name and the file that wins for it."""
    return _files.find_sites(search_path())


def load_site(name_or_path: str | Path) -> Site:
    """The site called NAME on the search path, or the site in the file at PATH."""
    return parse_site_file(_files.site_file(name_or_path, find_sites))


def parse_site_file(path: Path) -> Site:
    """The validated site in this file; every problem is one SiteError line naming the file."""
    from hpc_garage.core.site import parse_site_dict

    site = parse_site_dict({**_files.read_site_file(path), "path": path}, origin=str(path))
    if site.container is not None:
        _files.check_container_paths(site.container, str(path))
    return site


def with_container(site: Site, image: str, origin: str = "--container") -> Site:
    """The site with `image` as its container's (`--container IMAGE`, the `container` job variable): its own
    runtime and settings kept, or `runtime: auto` where it has none; its pools too (jobqueue)."""
    from hpc_garage.core.container import ContainerSettings

    def moved(one: Site) -> Site:
        base = one.container.model_dump() if one.container else {}
        container = ContainerSettings.model_validate({**base, "image": image})
        copy = one.model_copy(update={"container": container})
        copy._raw = {**one._raw, "container": container.model_dump()}
        return copy

    if not image.strip():
        raise _files.SiteError(f"{origin}: give an image (a path or a reference), not an empty value")
    site_ = moved(site)
    site_._pool_sites = {name: moved(pool) for name, pool in site._pool_sites.items()}
    _files.check_container_paths(site_.container, origin)  # type: ignore[arg-type]
    return site_
