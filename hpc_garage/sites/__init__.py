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

    return parse_site_dict({**_files.read_site_file(path), "path": path}, origin=str(path))
