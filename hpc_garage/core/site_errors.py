"""pydantic's errors on a site file as one line: the key, the bad value and the fix.

A site file is usually written once, by hand, from the README, so each mistake names its key (`node.gpus`,
`pools.big.jobqueue.jobs`), the value written and what to write instead; an unknown key gets the closest known
one. Any model of core/site.py can be described: its fields tell which keys are known where.
"""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ValidationError

__all__ = ["describe_validation_error"]


def describe_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """pydantic's errors as one line: `node.gpus: -1 is not allowed: must be >= 0`; unknown keys get did-you-mean."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = [str(x) for x in err["loc"] if x != "path"]
        key = ".".join(loc) or "(top level)"
        kind, value = err["type"], err.get("input")
        if kind == "extra_forbidden":
            known = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys here: {', '.join(known)}"
            parts.append(f"unknown key {key!r}; {hint}")
        elif kind == "missing":
            parts.append(f"missing key {key!r}; add it")
        elif kind == "literal_error":
            allowed = err.get("ctx", {}).get("expected", "")
            parts.append(f"{key}: {value!r} is not allowed; use one of {allowed}")
        elif kind in _FIXES:
            parts.append(f"{key}: {value!r} {_FIXES[kind].format(**err.get('ctx', {}))}")
        else:
            message = err["msg"].removeprefix("Value error, ")
            # our own validators already quote the value; pydantic's messages do not
            shown = "" if kind == "value_error" or isinstance(value, dict) else f"{value!r}: "
            parts.append(f"{key}: {shown}{message}" if loc else message)
    return "; ".join(parts)


_FIXES = {
    "greater_than_equal": "is too small; use a number >= {ge}",
    "greater_than": "is too small; use a number > {gt}",
    "less_than_equal": "is too large; use a number <= {le}",
    "int_parsing": "is not a whole number; write e.g. 4",
    "int_type": "is not a whole number; write e.g. 4",
    "int_from_float": "is not a whole number; write e.g. 4",
    "string_type": "is not text; quote it",
    "list_type": "is not a list; write one item per line, each starting with '- '",
    "dict_type": "is not a mapping; write `key: value` lines indented under it",
    "model_type": "is not a mapping; write `key: value` lines indented under it",
    "model_attributes_type": "is not a mapping; write `key: value` lines indented under it",
    "string_pattern_mismatch": "has characters that are not allowed; use letters, digits, '.', '_' and '-'",
}


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    skip = False
    for name in loc:
        if skip:  # the key of a `dict[str, Model]` (a pool's name)
            skip = False
            continue
        field = model.model_fields.get(name)
        annotation = getattr(field, "annotation", None)
        args = getattr(annotation, "__args__", ())
        if getattr(annotation, "__origin__", None) is dict and args and isinstance(args[-1], type) \
                and issubclass(args[-1], BaseModel):
            annotation, skip = args[-1], True
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [n for n in model.model_fields if n != "path"]
