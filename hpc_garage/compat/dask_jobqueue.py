"""dask-jobqueue's private names: how its Job classes run batch commands and submit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hpc_garage.compat.versions import uses


@uses("dask-jobqueue", "Job._call / Job._submit_job / Job._job_id_from_submit_output")
def hooked_job(base: type) -> type:
    """A dask-jobqueue Job class whose batch commands run with `call_options()` (the subclass says: a clean
    environment, their own session) and whose every submission is reported to `submitted(future, parse)`
    and finished even if its caller is cancelled (so a job submitted by an interrupted start-up is known and
    cancelled)."""

    class Hooked(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def call_options() -> dict[str, Any]:
            return {}

        def submitted(self, submission: asyncio.Future[str], parse: Callable[[str], str]) -> None:
            """Called with each submission under way and the parser of its output into a job id."""

        @classmethod
        async def _call(cls, cmd: list[str], **kwargs: Any) -> str:
            return await base._call(cmd, **{**cls.call_options(), **kwargs})

        async def _submit_job(self, script_filename: str) -> str:
            inner = asyncio.ensure_future(base._submit_job(self, script_filename))
            self.submitted(inner, self._job_id_from_submit_output)
            return await asyncio.shield(inner)

    Hooked.__name__ = Hooked.__qualname__ = f"Hooked{base.__name__}"
    return Hooked
