"""prefect-dask's private names: what a DaskTaskRunner holds, and a PrefectDaskFuture's Dask future."""

from __future__ import annotations

import functools
import zlib
from typing import Any

from hpc_garage.compat.versions import uses


@uses("prefect-dask", "DaskTaskRunner._started / _cluster")
def runner_started(runner: Any) -> bool:
    """Whether a DaskTaskRunner has entered (its client exists)."""
    return bool(runner._started)


@uses("prefect-dask", "DaskTaskRunner._cluster")
def runner_has_cluster(runner: Any) -> bool:
    """Whether a DaskTaskRunner was given a cluster object (rather than an address or a class to start)."""
    return runner._cluster is not None


def dask_futures(runner: Any, values: Any) -> Any:
    """`values` with every PrefectDaskFuture replaced by its dask future, as prefect-dask submits them
    (`DaskTaskRunner._optimize_futures`); a released one (prefect/in_flight.py) by its final State, which
    Prefect's engine resolves to its result and records as the upstream task run."""
    from prefect.utilities.collections import visit_collection

    return visit_collection(values, visit_fn=in_dask, return_data=True)


@uses("prefect-dask", "PrefectDaskFuture._wrapped_future / _final_state (prefect's PrefectWrappedFuture)")
def in_dask(value: Any) -> Any:
    """What stands for a Prefect future among a task's arguments: its Dask future, or its final State."""
    from prefect_dask.task_runners import PrefectDaskFuture

    if isinstance(value, PrefectDaskFuture):
        wrapped = value._wrapped_future
        return wrapped if wrapped is not None else value._final_state
    return value


@uses("prefect-dask", "PrefectDaskFuture._wrapped_future / _final_state (prefect's PrefectWrappedFuture)")
def release_future(future: Any, state: Any) -> None:
    """Keep `future`'s final State and drop its Dask future (the scheduler and worker then forget the task).
    The state goes first: a reader that finds no Dask future finds the state."""
    future._final_state = state
    future._wrapped_future = None


@functools.cache
def releasing_future_class() -> type:
    """PrefectDaskFuture, for a future `release_future` may release: its wait() and result() use the final
    State once the Dask future is gone (prefect-dask's would call the missing Dask future)."""
    from prefect_dask.task_runners import PrefectDaskFuture

    class ReleasingFuture(PrefectDaskFuture):  # type: ignore[misc, valid-type]
        """Each method reads the Dask future once: the releaser may drop it between two reads. Its final State
        is kept packed (pack_state): a flow holds every released future its user keeps."""

        @uses("prefect-dask", "PrefectDaskFuture._wrapped_future / _final_state")
        def wait(self, timeout: float | None = None) -> None:
            if self._final_state is None and self._wrapped_future is not None:
                super().wait(timeout)  # prefect-dask's: a Dask future dropped meanwhile is taken as done

        @uses("prefect-dask", "PrefectDaskFuture._wrapped_future / _final_state")
        def final(self, timeout: float | None = None) -> Any:
            """The final State (waited for), or what the Dask future holds where that is not a State;
            prefect-dask's result() up to reading the State's value."""
            import distributed
            from prefect.client.schemas.objects import State

            wrapped = self._wrapped_future
            if self._final_state is None and wrapped is not None:
                try:
                    value = wrapped.result(timeout=timeout)
                except distributed.TimeoutError as exc:
                    raise TimeoutError(f"Task run {self.task_run_id} did not complete within {timeout} "
                                       "seconds") from exc
                if not isinstance(value, State):
                    return value
                self._final_state = value
            return self._final_state

        @uses("prefect-dask", "PrefectDaskFuture._wrapped_future / _final_state")
        def add_done_callback(self, fn: Any) -> None:
            wrapped = self._wrapped_future
            if self._final_state is None and wrapped is not None:
                wrapped.add_done_callback(lambda _: fn(self))
                return
            fn(self)

        @property
        @uses("prefect-dask", "PrefectDaskFuture._wrapped_future")
        def released(self) -> bool:
            return self._wrapped_future is None

        @property  # type: ignore[override]
        def _final_state(self) -> Any:
            """Prefect's attribute for the final State, which every reader of it uses; kept packed (pack_state)."""
            held = self.__dict__.get("_packed_state")
            return unpack_state(held) if isinstance(held, bytes) else held

        @_final_state.setter
        def _final_state(self, state: Any) -> None:
            self.__dict__["_packed_state"] = pack_state(state)

    return ReleasingFuture


def pack_state(state: Any) -> Any:
    """A final State as a released future keeps it (a flow holds one per trial: 300,000 in a big sweep). One
    whose value is in the results store (record metadata as its data) as JSON compressed against a typical such
    State: ~0.15 KB, where its objects take ~5 KB; any other State as it is (its value is in it)."""
    from prefect.results import ResultRecordMetadata

    if isinstance(getattr(state, "data", None), ResultRecordMetadata):
        try:
            packer = zlib.compressobj(6, zdict=_typical_state())
            return packer.compress(state.model_dump_json().encode()) + packer.flush()
        except Exception:  # noqa: BLE001 - a State that does not serialize is kept as it is
            return state
    return state


def unpack_state(packed: bytes) -> Any:
    """The State pack_state packed: equal to it (id, timestamps, details, the record metadata)."""
    from prefect.client.schemas.objects import State

    unpacker = zlib.decompressobj(zdict=_typical_state())
    return State.model_validate_json(unpacker.decompress(packed) + unpacker.flush())


@functools.cache
def _typical_state() -> bytes:
    """What most of a packed State's JSON repeats (its field names and defaults), as zlib's preset dictionary.
    Fixed ids and time: the same bytes in every process of one Prefect version (a future that travels pickled
    unpacks where it lands)."""
    import datetime
    import uuid

    from prefect.results import ResultRecordMetadata
    from prefect.serializers import PickleSerializer
    from prefect.states import Completed

    state = Completed(data=ResultRecordMetadata(storage_key="/results/" + "0" * 64, serializer=PickleSerializer()))
    state.id = state.state_details.flow_run_id = state.state_details.task_run_id = uuid.UUID(int=0)
    state.timestamp = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    return state.model_dump_json().encode()
