"""The versions each package's private names were verified on, and the gate every use goes through.

`VERIFIED` is the range of each package the uses were checked against (`pyproject.toml`'s bounds are the same
ranges; tests/test_compat.py holds them equal). `@uses(package, what)` declares a use and turns an
AttributeError or ImportError from it into a `CompatError`: one line naming the package, its version and the
range. `python -m hpc_garage.compat [--latest]` compares them with what is installed and what is released.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hpc_garage.core.errors import UserError


# package → [lowest verified, first unverified): the installed versions were checked by the test suite
VERIFIED: dict[str, tuple[str, str]] = {
    "distributed": ("2026.8.0", "2026.9.0"),
    "dask-jobqueue": ("0.9.0", "0.10.0"),
    "prefect": ("3.8.0", "3.10.0"),
    "prefect-dask": ("0.3.7", "0.4.0"),
}


class CompatError(UserError):
    """An installed package lacks a private name hpc-garage needs: install a verified version."""


@dataclass(frozen=True)
class Use:
    package: str
    what: str  # the private name, as the package spells it
    function: str  # the function here that touches it


USES: list[Use] = []
F = TypeVar("F", bound=Callable[..., Any])


def uses(package: str, what: str) -> Callable[[F], F]:
    """Declare that the decorated function touches `what` of `package`; an AttributeError or ImportError
    from it becomes a CompatError naming the package, its version and the verified range."""

    def decorate(function: F) -> F:
        USES.append(Use(package, what, function.__name__))

        def explain(exc: BaseException) -> CompatError:
            return CompatError(f"{package} {version(package)} has no {what} (hpc-garage uses it, verified on "
                               f"{package}>={VERIFIED[package][0]},<{VERIFIED[package][1]}: {exc}); "
                               f"install {package}>={VERIFIED[package][0]},<{VERIFIED[package][1]}")

        if asyncio.iscoroutinefunction(function):
            @functools.wraps(function)
            async def guarded_async(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await function(*args, **kwargs)
                except (AttributeError, ImportError) as exc:
                    raise explain(exc) from None

            return guarded_async  # type: ignore[return-value]

        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except (AttributeError, ImportError) as exc:
                raise explain(exc) from None

        return guarded  # type: ignore[return-value]

    return decorate


@functools.cache
def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _key(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _installed_key(package: str, installed: str | None = None) -> tuple[int, ...] | None:
    """The installed release of `package` as numbers; None where it is not installed."""
    text = version(package) if installed is None else installed
    return _key(text) if re.match(r"\d", text) else None


def at_least(package: str, lowest: str) -> bool:
    """Whether the installed `package` is `lowest` or newer: a behaviour that changed between verified versions."""
    key = _installed_key(package)
    return key is not None and key >= _key(lowest)


def in_range(package: str, installed: str | None = None) -> bool:
    low, high = VERIFIED[package]
    key = _installed_key(package, installed)
    return key is not None and _key(low) <= key < _key(high)


def uses_outside_range() -> list[str]:
    """One line per private use whose package is installed outside the verified range."""
    return [f"{u.package} {version(u.package)}: {u.what} ({u.function}; verified {VERIFIED[u.package][0]}.."
            f"<{VERIFIED[u.package][1]})" for u in USES if not in_range(u.package)]


def installed_versions() -> list[str]:
    """`hpc-garage --version`'s line per package: installed version, and whether it is in the verified range
    (read from the installed metadata: nothing is imported)."""
    lines = []
    for package, (low, high) in VERIFIED.items():
        installed, wanted = version(package), f">={low},<{high}"
        if in_range(package, installed):
            lines.append(f"{package} {installed}: in the verified range {wanted}")
        else:
            lines.append(f"{package} {installed}: OUTSIDE the verified range {wanted} (hpc-garage's uses of its "
                         f"private names fall back or refuse); pip install '{package}{wanted}'")
    return lines


# --------------------------------------------------------------------------- the registry's newest releases


def newest_release(releases: list[str]) -> str | None:
    """The newest final release (no a/b/rc/dev/post suffix: pip does not pick those either), or None."""
    final = [r for r in releases if re.fullmatch(r"\d+(\.\d+)*", r.strip())]
    return max(final, key=lambda r: tuple(int(x) for x in r.split(".")), default=None)


def release_news(newest: dict[str, str | None]) -> list[tuple[bool, str]]:
    """(still verified, line) per package of VERIFIED, from its newest release on the registry (None: none
    found). A release at or past the range's first unverified version is news: verify it, then widen."""
    news = []
    for package, (low, high) in VERIFIED.items():
        release, wanted = newest.get(package), f">={low},<{high}"
        if release is None:
            news.append((False, f"{package}: no release found on the registry (verified {wanted})"))
        elif _key(release) >= _key(high):
            news.append((False, f"{package} {release} is released, past the verified range {wanted}: run the "
                                f"tests on it (the fast path, every private name in hpc_garage/compat/), then widen "
                                "VERIFIED there and pyproject.toml's bound"))
        else:
            news.append((True, f"{package} {release} (newest): in the verified range {wanted}"))
    return news


def registry_releases(package: str) -> list[str]:
    """Every version of `package` on the package index, as `pip index versions` lists them (the user's pip
    configuration holds: index, mirror, proxy)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise UserError(f"`pip index versions {package}` did not answer within 120 s; check the network or "
                        "pip's index configuration (pip config list)") from None
    listed = next((line for line in done.stdout.splitlines() if line.startswith("Available versions:")), None)
    if done.returncode != 0 or listed is None:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"`pip index versions {package}` failed ({said}); check the network or pip's index "
                        "configuration (pip config list)")
    return [v.strip() for v in listed.split(":", 1)[1].split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    """`python -m hpc_garage.compat [--latest]`: the installed versions against the verified ranges; with
    --latest also each package's newest release on the index. Exit 1 where one is past its range."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m hpc_garage.compat", description=main.__doc__)
    parser.add_argument("--latest", action="store_true", help="also ask the package index for the newest releases")
    args = parser.parse_args(argv)
    for line in installed_versions():
        print(line)
    if not args.latest:
        return 0 if all(in_range(p) for p in VERIFIED) else 1
    try:
        news = release_news({p: newest_release(registry_releases(p)) for p in VERIFIED})
    except UserError as exc:
        print(f"hpc-garage: error: {exc}", file=sys.stderr)
        return 2
    for _, line in news:
        print(line)
    return 0 if all(ok for ok, _ in news) else 1
