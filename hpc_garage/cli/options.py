"""What every command shares: the command class that refuses an option given twice or two that exclude each
other, the request flags (built from core/request_options.py's table) and the parsers of other option values.
Light: nothing here imports more than click, core and variables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from hpc_garage.core.errors import UserError
from hpc_garage.variables import SITE_ENV


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


def request_flags(names: Sequence[str] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The click options of core/request_options.py's rows `names` (default: every row with a flag), in the
    table's order: their spellings, help and reading are the table's; the site also comes from $HPC_GARAGE_SITE.
    Each request flag reaches the command as its Request field (`memory` for --mem), the site as `site_name`."""
    from hpc_garage.core.request_options import BY_NAME, OPTIONS

    rows = [o for o in OPTIONS if o.flags] if names is None else [BY_NAME[name] for name in names]

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(rows):  # click lists the decorator applied last first
            settings: dict[str, Any] = {"help": option.help}
            if option.kind == "count":
                settings["type"] = int
            elif option.kind == "flag":
                settings["is_flag"] = True
            elif option.kind in ("memory", "walltime"):
                settings["callback"] = _reader(option)
            param = option.field or option.name
            if option.name == "site":
                param, settings["envvar"], settings["required"] = "site_name", SITE_ENV, True
            function = click.option(*option.flags, param, **settings)(function)
        return function

    return decorate


def _reader(option: Any) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that reads a value as the table's row does (`RequestOption.read`)."""

    def read(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            return option.read(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    return read


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
