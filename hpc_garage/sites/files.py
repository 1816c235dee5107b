"""Finding and reading site files: everything about site files but pydantic.

Kept apart from `hpc_garage.core.site` (the pydantic models) so that `show` and `sites` can load a site without
importing pydantic, which alone costs as much as importing click (see `hpc_garage.sites.view`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hpc_garage.core.errors import SiteError
from hpc_garage.core.site_values import DEFAULT_RUN_DIRECTORY, NAME_PATTERN  # noqa: F401 (NAME_PATTERN: API)
from hpc_garage.variables import SITES_PATH_ENV

if TYPE_CHECKING:
    from hpc_garage.core.container import ContainerSettings


# ---------------------------------------------------------------------------------------------- finding


def search_path(env: dict[str, str] | None = None) -> list[Path]:
    """Where site files are looked for, first match wins."""
    env = os.environ if env is None else env
    dirs = [Path(p).expanduser() for p in env.get(SITES_PATH_ENV, "").split(":") if p]
    dirs += [Path.cwd() / "site-configs", Path("~/.config/hpc-garage/sites").expanduser(), packaged_dir("site-configs")]
    return dirs


def packaged_dir(name: str) -> Path:
    """A data folder shipped with hpc-garage: inside the wheel, or beside the package in a source checkout."""
    package = Path(__file__).parent.parent
    inside = package / "_data" / name
    return inside if inside.is_dir() else package.parent / name


def find_sites(dirs: list[Path] | None = None) -> dict[str, Path]:
    """Every visible site name and the file that wins for it (on the search path, or in `dirs`)."""
    found: dict[str, Path] = {}
    for directory in search_path() if dirs is None else dirs:
        for file in sorted(directory.glob("*.y*ml")) if directory.is_dir() else []:
            if file.suffix in (".yaml", ".yml"):
                found.setdefault(file.stem, file)
    return found


def site_file(name_or_path: str | Path, find: Callable[[], dict[str, Path]] = find_sites) -> Path:
    """The file of the site called NAME among `find()` (the search path), or the file at PATH."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or os.sep in str(name_or_path):
        if candidate.is_dir():
            raise SiteError(f"site file {str(candidate)!r} is a directory; give the YAML file in it "
                            f"(`hpc-garage sites` lists the known ones)")
        if not candidate.is_file():
            raise SiteError(f"site file {str(candidate)!r} does not exist; check the path")
        return candidate
    sites = find()
    if str(name_or_path) not in sites:
        import difflib

        close = difflib.get_close_matches(str(name_or_path), list(sites), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SiteError(
            f"unknown site {str(name_or_path)!r}; {hint}`hpc-garage sites` lists the {len(sites)} known sites "
            f"(searched ${SITES_PATH_ENV}, ./site-configs, ~/.config/hpc-garage/sites and the packaged sites)"
        )
    return sites[str(name_or_path)]


# ---------------------------------------------------------------------------------------------- reading


class _SiteLoader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 integers, so `walltime: 01:00:00` stays a string."""


_SiteLoader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:int"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SiteLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(0|[1-9][0-9_]*)$"), list("-+0123456789")
)


def _unique_mapping(loader: _SiteLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    """A mapping whose keys are each given once: YAML would keep the last of two, silently."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                "keep one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_SiteLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_site_file(path: Path) -> dict[str, Any]:
    """The file's keys as written, `name` defaulting to the file's stem; not yet validated."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_SiteLoader)
    except UnicodeDecodeError as exc:
        raise SiteError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
                        "save it as UTF-8") from None
    except IsADirectoryError:
        raise SiteError(f"{path}: is a directory, not a site file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SiteError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}; fix the syntax") from None
    except OSError as exc:
        raise SiteError(f"{path}: cannot read: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise SiteError(f"{path}: expected a mapping of keys (scheduler:, node:, ...), got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return data


def directories(path: Path) -> tuple[str, str | None]:
    """The file's `run_directory` and `results_directory` as written (the defaults where absent), without
    validating the rest: where `status`, `cancel` and `resume` look for jobs and sweeps, so that finding one
    costs no site model, and a site file broken elsewhere still shows its jobs. One not a string: SiteError."""
    data = read_site_file(path)
    run, results = data.get("run_directory", DEFAULT_RUN_DIRECTORY), data.get("results_directory")
    for key, value, optional in (("run_directory", run, False), ("results_directory", results, True)):
        if not (isinstance(value, str) and value.strip() or optional and value is None):
            raise SiteError(f"{path}: {key}: {value!r} is not a path; give a directory")
    return run, results


def check_container_paths(container: ContainerSettings, origin: str) -> None:
    """A container's image file and binds must exist where the site is read (login and compute nodes share
    them): refused in one line now, not as a runtime's error in the job log. Paths with variables ($TMPDIR)
    expand on the node, so they are left to the runtime."""
    if container.image_is_path and "$" not in container.image \
            and not Path(container.image).expanduser().exists():
        raise SiteError(f"{origin}: container.image: {container.image!r} does not exist; build or copy the image "
                        "there, or give the path of one that does (docs/how-to/containers.md)")
    for bind in container.binds:
        source = bind.split(":", 1)[0]
        if "$" not in source and not Path(source).expanduser().exists():
            raise SiteError(f"{origin}: container.binds: {source!r} does not exist on this machine; create it or "
                            "drop the bind")
