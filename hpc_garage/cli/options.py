"""What every command shares: the command class that refuses an option given twice or two that exclude each
other, and the parsers of option values. Light: nothing here imports more than click and core."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from hpc_garage.core.errors import UserError


class Command(click.Command):
    """A command that refuses an option given twice (`--nodes 2 --nodes 3`, `-t 2h --time 3h`) instead of
    letting the last one win silently, and options that exclude each other (`exclusive`)."""

    def __init__(self, *args: Any, exclusive: tuple[tuple[str, ...], ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exclusive = exclusive

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        refuse_repeats(self, ctx, args)
        rest = super().parse_args(ctx, args)
        for group in self.exclusive:
            given = [name for name in group if ctx.params.get(name)]
            if len(given) > 1:
                flags = [self._flag(name) for name in given]
                raise UserError(f"{' and '.join(flags)} exclude each other; give one")
        return rest

    def _flag(self, name: str) -> str:
        return next(p.opts[0] for p in self.params if p.name == name)


def command(name: str | None = None, **settings: Any) -> Callable[[Callable[..., Any]], Command]:
    """`@click.command` with this CLI's `Command`; the group in `hpc_garage/cli/__init__.py` adds it."""
    return click.command(name, cls=Command, **settings)  # type: ignore[return-value]


def refuse_repeats(command: click.Command, ctx: click.Context, args: list[str]) -> None:
    by_opt = {opt: p for p in command.params if isinstance(p, click.Option) and not (p.multiple or p.count)
              for opt in p.opts + p.secondary_opts}
    seen: dict[str, tuple[str, str | None]] = {}
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if word == "--":
            return
        if not word.startswith("-") or word == "-":
            if not ctx.allow_interspersed_args:
                return
            continue
        name, eq, value = word.partition("=") if word.startswith("--") else (word[:2], "", word[2:])
        param = by_opt.get(name)
        if param is None:
            continue
        attached: str | None = (value if eq or value else None)
        if not param.is_flag and attached is None and i < len(args):
            attached, i = args[i], i + 1
        if param.name in seen:
            first, before = seen[param.name]
            shown = f" ({before!r} and {attached!r})" if before is not None or attached is not None else ""
            raise UserError(f"{first} given twice{'' if first == name else f' (as {name})'}{shown}; give it once")
        seen[param.name] = (name, attached)  # type: ignore[index]


# ------------------------------------------------------------------------------------------ option values


def memory(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """Memory per node; 0 means what sbatch's --mem=0 means: the node's memory (the site's default)."""
    from hpc_garage.core.units import parse_memory

    try:
        return None if value is None else parse_memory(value) or None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def walltime(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from hpc_garage.core.units import parse_walltime

    try:
        return None if value is None else parse_walltime(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def request_of(options: dict[str, Any]) -> Any:
    """The request flags of a command as one core Request."""
    from hpc_garage.core.request import Request

    return Request(**{k: v for k, v in options.items() if v is not None})


def host(value: str) -> str:
    """An IP address or a host name: it names a directory of the server's state, so nothing else."""
    import ipaddress
    import re

    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    if re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*",
                    value):
        return value
    raise click.BadParameter(f"{value!r}: give an IP address or a host name, e.g. 127.0.0.1")


def seconds(value: str) -> float:
    import math

    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 < seconds <= 7 * 86400:
        raise click.BadParameter(f"{value!r}: give seconds, more than 0 and at most a week, e.g. 180")
    return seconds
