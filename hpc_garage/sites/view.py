"""A site loaded without pydantic, for `show` and `sites`: importing pydantic and building the site models
costs ~150 ms, more than the whole rest of `hpc-garage show` (issue 5: show within 3x `import click`).

`load(name)` checks the site file against the models' fields as plain data: `sites.fields`, generated from
`hpc_garage.core.site` by `python -m hpc_garage.sites.fields_gen` (names, order, defaults, kinds, bounds, patterns,
choices, the `site_values` converters). It vouches only for values of the plain kinds a hand-written file holds
(ints, strings, lists of strings, the documented units) that pass every check; for anything else (an error, a type
pydantic would coerce, a key of a type it does not check such as `pools:`, a section with validators it does not
mirror such as `jobqueue:`, a jobqueue site) it returns the pydantic `Site` from `hpc_garage.sites.parse_site_file`,
so every error message, and every accepted value, is pydantic's. tests/test_siteview.py holds fields.py to the
models and, for generated files, the view's values to the model's whenever the view accepts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core import site_values
from hpc_garage.sites import fields
from hpc_garage.sites import files as sitefiles

if TYPE_CHECKING:
    from hpc_garage.core.site import Site


class _Unsure(Exception):
    """A value the fast path does not vouch for: pydantic decides."""


Check = Callable[[Any], Any]
REQUIRED = object()

# The model validators (and serializers, computed fields) the view mirrors, per section: `view()` repeats
# Site._consistent's checks for mpi sites, and Site._pools_merged does nothing more where there are no pools.
# A section with a hook not named here is pydantic's alone: given in a file, pydantic loads the site.
MIRRORED = {"site": {"_consistent", "_pools_merged"}, "container": {"_plain"}}  # a container: never vouched for
TRUSTED = {key for key, section in fields.SECTIONS.items() if set(section["hooks"]) <= MIRRORED.get(key, set())}


def _test(spec: dict[str, Any]) -> Callable[[Any], bool]:
    """Whether a value (converted already) is one the fast path vouches for: of the kind, within the bounds."""
    kind = spec["kind"]
    if kind == "int":
        gt, ge, lt, le = (spec.get(k) for k in ("gt", "ge", "lt", "le"))
        return lambda v: type(v) is int and (gt is None or v > gt) and (ge is None or v >= ge) \
            and (lt is None or v < lt) and (le is None or v <= le)
    if kind == "bool":
        return lambda v: type(v) is bool
    if kind == "str":
        pattern = spec.get("pattern")
        if pattern is None:
            return lambda v: type(v) is str
        regex = re.compile(pattern)
        # pydantic searches with Rust's regex, whose `$` is the end of the text; Python's also matches before a
        # final newline, so text with a newline is left to pydantic
        return lambda v: type(v) is str and "\n" not in v and regex.search(v) is not None
    if kind == "choice":
        choices = frozenset(spec["choices"])
        return lambda v: type(v) is str and v in choices
    if kind == "list[str]":
        return lambda v: type(v) is list and all(type(x) is str for x in v)
    if kind == "dict[str, str]":
        return lambda v: type(v) is dict and all(type(k) is str and type(x) is str for k, x in v.items())
    raise ValueError(f"sites.fields: unknown kind {kind!r}; regenerate it (python -m hpc_garage.sites.fields_gen)")


def _check(spec: dict[str, Any]) -> Check | None:
    """The check of one plain field: its value as the model holds it, or _Unsure. None for sections and `any`."""
    if spec["kind"] in ("section", "any"):
        return None
    optional, test = spec.get("optional", False), _test(spec)
    convert = getattr(site_values, spec["convert"]) if "convert" in spec else None
    copy = list if spec["kind"] == "list[str]" else dict if spec["kind"] == "dict[str, str]" else None

    def check(value: Any) -> Any:
        if optional and value is None:
            return None
        if convert is not None:
            try:
                value = convert(value)
            except Exception:  # pydantic reports it
                raise _Unsure from None
        if test(value):
            return value if copy is None else copy(value)
        raise _Unsure

    return check


def _table(key: str) -> list[tuple[str, Any, Check | None]]:
    """A section's fields, in its model's order: (name, default, check). Defaults are never checked, as in
    pydantic; a mutable default is copied per site."""
    return [(spec["name"], spec.get("default", REQUIRED), _check(spec)) for spec in fields.SECTIONS[key]["fields"]]


SITE = _table("site")
SECTIONS = {key: _table(key) for key in fields.SECTIONS if key != "site"}
# the fields that are nested models, per section: {("site", "node"): ("node", optional), ...}
NESTED = {(key, spec["name"]): (spec["section"], spec.get("optional", False))
          for key, section in fields.SECTIONS.items() for spec in section["fields"] if spec["kind"] == "section"}
NAMES = {key: frozenset(spec["name"] for spec in section["fields"]) for key, section in fields.SECTIONS.items()}
EXCLUDED = frozenset(fields.SECTIONS["site"]["excluded"])  # not YAML keys (path)


class Section:
    """One nested model's values (node, workers, limits, mpi, jobqueue), as attributes."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        return {k: SiteView._dump(v) for k, v in self.__dict__.items()}


class SiteView:
    """A site the fast path vouched for: the same attributes and `model_dump` as the pydantic `Site`."""

    def __init__(self, values: dict[str, Any], raw: dict[str, Any], path: Path | None) -> None:
        self.__dict__.update(values)
        self.path, self._raw = path, raw

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """What `Site.model_dump` gives (`path` excluded); every value is already a JSON type."""
        return {name: self._dump(getattr(self, name)) for name, _, _ in SITE}

    @staticmethod
    def _dump(value: Any) -> Any:
        return value.model_dump() if isinstance(value, Section) else _copied(value)

    @property
    def raw(self) -> dict[str, Any]:
        return dict(self._raw)

    @property
    def gpu_env_vars(self) -> tuple[str, ...]:
        """Variables that pin a process to its GPUs on this site's hardware (as `Site.gpu_env_vars`)."""
        return ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES") if self.node.gpu_vendor == "amd" else (
            "CUDA_VISIBLE_DEVICES",
        )

    def full(self) -> Site:
        """The pydantic Site, for code that needs more than the view has (job environments, pools, scripts)."""
        from hpc_garage.core.site import Site

        return Site.model_validate({**self._raw, "path": self.path})


def load(name_or_path: str | Path) -> SiteView | Site:
    """The site NAME (or the file PATH): a SiteView when the fast path vouches for it, else pydantic's Site."""
    path = sitefiles.site_file(name_or_path)
    data = sitefiles.read_site_file(path)
    try:
        return view(data, path)
    except _Unsure:
        from hpc_garage.sites import parse_site_file

        return parse_site_file(path)


def full(site: SiteView | Site) -> Site:
    """The pydantic Site of either."""
    return site.full() if isinstance(site, SiteView) else site


def view(data: dict[str, Any], path: Path | None = None) -> SiteView:
    """The checked site, or _Unsure: for anything but plain values that pass every check of the models."""
    if "site" not in TRUSTED:
        raise _Unsure  # Site has a validator the view does not mirror: see MIRRORED
    raw = {k: v for k, v in data.items() if k not in EXCLUDED}
    if raw.get("container") is not None:
        raise _Unsure  # a container: its checks (ContainerSettings._plain, the GPU vendor, its paths) are pydantic's
    values = _fields("site", raw)
    node, workers, limits = values["node"], values["workers"], values["limits"]
    # Site._consistent's checks: a site failing one goes to pydantic, which words the error
    if values["scheduler"] not in site_values.BATCH_SYSTEMS:
        raise _Unsure
    if values["launcher"] != "mpi":
        raise _Unsure  # jobqueue sites: Site._check_jobqueue and _pools_merged's pool checks are pydantic's
    if workers.per == "gpu" and node.gpus == 0 or workers.reserve_memory >= node.memory:
        raise _Unsure
    if limits.max_gpus_per_node is not None and limits.max_gpus_per_node > node.gpus:
        raise _Unsure
    if limits.max_walltime is not None and values["walltime"] > limits.max_walltime:
        raise _Unsure
    # Site._check_contradictions: the same, each failing site to pydantic
    if "processes" in (raw.get("workers") or {}) and workers.per != "process":
        raise _Unsure
    if values["scheduler"] not in site_values.LAUNCHES_RANKS and "srun" in (values["mpi"].launch, values["mpi"].via):
        raise _Unsure
    if "via" in (raw.get("mpi") or {}) and values["mpi"].launch != "dask-mpi":
        raise _Unsure
    if values["warning_signal"] and values["scheduler"] not in site_values.SIGNALS_BEFORE_END:
        raise _Unsure
    if any(not line.startswith("-") for line in values["directives"]):
        raise _Unsure
    if any(not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or "\0" in v for k, v in values["env"].items()):
        raise _Unsure
    return SiteView(values, raw, path)


def _fields(key: str, data: Any) -> dict[str, Any]:
    """The values of section KEY given as DATA: checked, or defaults where not given."""
    if type(data) is not dict or not data.keys() <= NAMES[key]:
        raise _Unsure  # not a mapping, or an unknown key
    values: dict[str, Any] = {}
    for name, default, check in SITE if key == "site" else SECTIONS[key]:
        if name not in data:
            if default is REQUIRED:
                raise _Unsure
            values[name] = _default(key, name, default)
        elif check is not None:
            values[name] = check(data[name])
        else:
            sub, optional = NESTED.get((key, name), (None, False))
            if sub is None or sub not in TRUSTED:
                raise _Unsure  # a type the view does not check (pools:), or a section it does not (jobqueue:)
            values[name] = None if optional and data[name] is None else Section(_fields(sub, data[name]))
    return values


def _default(key: str, name: str, default: Any) -> Any:
    """A field's default, copied; a nested model's (its dump) as a Section."""
    sub, _ = NESTED.get((key, name), (None, False))
    if sub is not None and type(default) is dict:
        return Section({k: _default(sub, k, v) for k, v in default.items()})
    return _copied(default)


def _copied(value: Any) -> Any:
    if type(value) is list:
        return [_copied(v) for v in value]
    if type(value) is dict:
        return {k: _copied(v) for k, v in value.items()}
    return value
