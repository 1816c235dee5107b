"""The `hpc-garage` work pool's job variables as Prefect takes them, built from core/request_options.py's table:
the run form (`GarageVariables`: one field per option, with its help, label, bounds and default; Prefect's UI
builds the form from its JSON schema) and the job configuration's fields (the same names, each templated from
its variable and checked by hpc-garage's own rules, so loosely typed here)."""

from __future__ import annotations

from typing import Any, Optional

from prefect.workers.base import BaseJobConfiguration, BaseVariables
from pydantic import Field, create_model

from hpc_garage.core.request_options import OPTIONS, RequestOption

NOT_OURS = ("name", "labels", "command")  # BaseVariables' fields the job does not use: not in the run form

_TYPES: dict[str, Any] = {"count": Optional[int], "memory": Optional[str], "walltime": Optional[str],
                          "text": Optional[str], "flag": bool, "directives": list[str]}


def _field(option: RequestOption) -> tuple[Any, Any]:
    settings: dict[str, Any] = {"description": option.help}
    if option.title:
        settings["title"] = option.title
    if option.minimum is not None:
        settings["ge"] = option.minimum
    if isinstance(option.default, list):
        settings["default_factory"] = list
    else:
        settings["default"] = option.default
    return _TYPES[option.kind], Field(**settings)


class _Variables(BaseVariables):
    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        schema = super().model_json_schema(*args, **kwargs)
        for name in NOT_OURS:
            schema["properties"].pop(name, None)
        return schema


GarageVariables = create_model(  # type: ignore[call-overload]
    "GarageVariables", __base__=_Variables, __doc__="The run form: `hpc-garage submit`'s flags, one field each.",
    __module__=__name__, **{option.name: _field(option) for option in OPTIONS})

JobVariableFields = create_model(  # type: ignore[call-overload]
    "JobVariableFields", __base__=BaseJobConfiguration, __module__=__name__,
    **{option.name: (Any, None) for option in OPTIONS})
