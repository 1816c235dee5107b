"""prefect_fast's worker-side tuning of Prefect (the runner's end-to-end behaviour is in test_prefect*.py)."""

from __future__ import annotations

import contextlib
import time
from typing import Any
import inspect

import pytest

pytest.importorskip("prefect")

from prefect.concurrency import services  # noqa: E402

from hpc_garage.prefect import fast as prefect_fast  # noqa: E402


def test_workers_trust_no_tag_limits_for_a_minute_and_prefect_reads_the_stretched_cache(monkeypatch) -> None:  # noqa: ANN001
    original = services._no_limits_cache
    monkeypatch.setattr(services, "_no_limits_cache", original)  # restored after the test
    assert original.ttl == 5.0  # Prefect's own: if this changes, revisit TAG_LIMITS_TTL
    assert prefect_fast.trust_no_tag_limits_longer() is True
    stretched = services._no_limits_cache
    assert stretched is not original and stretched.ttl == prefect_fast.TAG_LIMITS_TTL == 60.0
    assert stretched.maxsize == original.maxsize
    # Prefect looks the cache up by its module-global name at each acquisition, so the new one is used
    own_acquire = inspect.unwrap(services.ConcurrencySlotAcquisitionWithLeaseService.acquire)  # under compat's
    assert "_no_limits_cache" in own_acquire.__code__.co_names  # tag_limits_survive_outages
    assert prefect_fast.trust_no_tag_limits_longer() is True and services._no_limits_cache is stretched  # once


def test_a_longer_cache_of_prefects_own_is_left_alone(monkeypatch) -> None:  # noqa: ANN001
    import cachetools

    longer = cachetools.TTLCache(maxsize=10, ttl=3600)
    monkeypatch.setattr(services, "_no_limits_cache", longer)
    prefect_fast.trust_no_tag_limits_longer()
    assert services._no_limits_cache is longer


def test_a_cached_no_limits_answer_is_read_in_the_tasks_own_thread(monkeypatch) -> None:  # noqa: ANN001
    """Prefect's sync `concurrency()` (the task engine's) gets "no limits" from Prefect's own cache without
    hopping threads; whatever the cache does not hold (or a strict or non-task acquisition) takes Prefect's path."""
    import uuid

    import cachetools
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency import _sync

    from hpc_garage import compat

    asked: list[list[str]] = []
    monkeypatch.setattr(_sync, "acquire_concurrency_slots_with_lease", lambda names, *a, **k: asked.append(names))
    monkeypatch.setattr(_sync, "_hpc_garage_in_thread", False, raising=False)
    monkeypatch.setattr(services, "_no_limits_cache", cachetools.TTLCache(maxsize=10, ttl=60))
    assert compat.answer_cached_tag_limits_in_thread() is True
    assert compat.answer_cached_tag_limits_in_thread() is True and asked == []  # installed once
    task_run = ConcurrencyLeaseHolder(type="task_run", id=uuid.uuid4())
    services._no_limits_cache[frozenset(["tag:a", "tag:b"])] = True
    with _sync.concurrency(["tag:b", "tag:a"], holder=task_run):
        pass
    assert asked == []  # answered here, from Prefect's cache
    answer = _sync.acquire_concurrency_slots_with_lease(["tag:a", "tag:b"], 1, holder=task_run)
    assert answer.limits == [] and answer.lease_id
    _sync.acquire_concurrency_slots_with_lease(["tag:c"], 1, holder=task_run)  # not cached
    _sync.acquire_concurrency_slots_with_lease(["tag:a", "tag:b"], 1, strict=True, holder=task_run)
    _sync.acquire_concurrency_slots_with_lease(["tag:a", "tag:b"], 1, holder=None)  # not a task run's tags
    assert asked == [["tag:c"], ["tag:a", "tag:b"], ["tag:a", "tag:b"]]


def test_an_expired_no_limits_answer_is_asked_again_in_the_background(monkeypatch) -> None:  # noqa: ANN001
    """Once Prefect's cache of "no limits" expires, trials are not held while the API is asked again (a busy
    server stalled every thread of a worker for up to 38 s): one background question per tag set; where limits
    exist now, the slot it took is given back and the next trials take Prefect's own path."""
    import threading
    import uuid

    import cachetools
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse
    from prefect.concurrency import _sync

    from hpc_garage import compat

    asked: list[list[str]] = []
    released: list[Any] = []
    answering, limits = threading.Event(), []
    lease = uuid.uuid4()

    def prefects(names: list[str], *args: Any, **kwargs: Any) -> Any:
        asked.append(names)
        assert answering.wait(10)
        return ConcurrencyLimitWithLeaseResponse.model_validate({"lease_id": str(lease), "limits": limits})

    monkeypatch.setattr(_sync, "acquire_concurrency_slots_with_lease", prefects)
    monkeypatch.setattr(_sync, "release_concurrency_slots_with_lease", released.append, raising=False)
    monkeypatch.setattr(_sync, "_hpc_garage_in_thread", False, raising=False)
    monkeypatch.setattr(services, "_no_limits_cache", cachetools.TTLCache(maxsize=10, ttl=60))
    assert compat.answer_cached_tag_limits_in_thread(stale_for=600) is True
    task_run = ConcurrencyLeaseHolder(type="task_run", id=uuid.uuid4())
    services._no_limits_cache[frozenset(["tag:a"])] = True
    assert _sync.acquire_concurrency_slots_with_lease(["tag:a"], 1, holder=task_run).limits == []
    services._no_limits_cache.clear()  # expired
    answers = [_sync.acquire_concurrency_slots_with_lease(["tag:a"], 1, holder=task_run) for _ in range(20)]
    assert all(a.limits == [] for a in answers) and asked == [["tag:a"]]  # answered at once; asked once, aside
    limits.append({"id": str(uuid.uuid4()), "name": "tag:a", "limit": 1})  # a limit created meanwhile
    answering.set()
    deadline = time.monotonic() + 10
    while not released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released == [lease]  # the slot the background question took, given back
    assert _sync.acquire_concurrency_slots_with_lease(["tag:a"], 1, holder=task_run).limits  # Prefect's path now
    assert asked == [["tag:a"], ["tag:a"]]
    assert _sync.acquire_concurrency_slots_with_lease(["tag:b"], 1, holder=task_run).limits  # never seen free
    services._no_limits_cache[frozenset(["tag:c"])] = True
    assert _sync.acquire_concurrency_slots_with_lease(["tag:c"], 1, holder=task_run).limits == []  # seen free
    services._no_limits_cache.clear()
    assert _sync.acquire_concurrency_slots_with_lease(["tag:c"], 1, holder=None).limits  # not a task run's: Prefect's
    assert asked == [["tag:a"], ["tag:a"], ["tag:b"], ["tag:c"]]


def test_the_docs_say_how_long_a_no_limits_answer_stands() -> None:
    """docs/explanation/speed.md's figures, literally: 60 s, then up to 10 minutes asked again in the background."""
    from pathlib import Path

    text = " ".join((Path(__file__).parents[1] / "docs" / "explanation" / "speed.md").read_text().split())
    assert prefect_fast.TAG_LIMITS_TTL == 60 and "hpc-garage's workers for 60 s" in text
    assert prefect_fast.TAG_LIMITS_STALE == 600 and "with the last answer (for up to 10 minutes;" in text


@pytest.mark.slow  # a real Prefect server (fixture `api`)
def test_a_tagged_task_asks_nothing_while_prefect_has_its_tags_cached(api: dict[str, str], monkeypatch) -> None:  # noqa: ANN001
    """compat.tag_limits_survive_outages probes the API (/health) only where Prefect's own "no limits for these
    tags" cache missed: a probe per tagged task cost 70% of tasks/s (bench/fault_cost.py). Against the real
    server, through Prefect's own acquisition."""
    import anyio
    import uuid

    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency._asyncio import aacquire_concurrency_slots_with_lease

    from hpc_garage import compat
    from hpc_garage.prefect.outage import api_answers, is_outage_error

    cls = services.ConcurrencySlotAcquisitionWithLeaseService
    monkeypatch.setattr(cls, "acquire", inspect.unwrap(cls.acquire))  # a fresh wrapper, restored after
    monkeypatch.setattr(cls, "_hpc_garage_survives", False)
    probes: list[bool] = []
    assert compat.tag_limits_survive_outages(is_outage_error, lambda: probes.append(api_answers()) or probes[-1],
                                             lambda message: None) is True

    def acquire() -> list:
        holder = ConcurrencyLeaseHolder(type="task_run", id=uuid.uuid4())
        return anyio.run(lambda: aacquire_concurrency_slots_with_lease(["tag:fast-test"], 1, holder=holder)).limits

    assert acquire() == [] and probes == []  # asked the API: no limits; the wrapper and Prefect's cache keep it
    assert [acquire() for _ in range(5)] == [[]] * 5 and probes == []  # from Prefect's cache: nothing asked
    services._no_limits_cache.clear()  # Prefect's cache missed: one probe first, then the API as before
    assert acquire() == [] and probes == [True]


def test_settings_of_an_active_profile_are_hashed_on_every_verified_prefect() -> None:
    """A profile with settings is active (a user's ~/.prefect/profiles.toml): Prefect 3.8.0 serializes its
    settings keyed by `Setting` objects, and the flow's first fast-path task failed with "keys must be str"
    (seen in a SLURM job on the oldest verified Prefect, `nox -s oldest`)."""
    from prefect.context import SettingsContext, use_profile
    from prefect.settings import PREFECT_API_URL, Profile

    with use_profile(Profile(name="mine", settings={PREFECT_API_URL: "http://mine.example:4200/api"}),
                     include_current_context=True):
        data = SettingsContext.get().serialize()
        payload = prefect_fast.Submitter()._settings()
    assert payload is not None and payload.data == data and len(payload.key) == 64
    assert prefect_fast._named_keys({PREFECT_API_URL: 1, "a": [{PREFECT_API_URL: 2}]}) == \
        {"PREFECT_API_URL": 1, "a": [{"PREFECT_API_URL": 2}]}


@pytest.mark.parametrize(("busy_for", "up"), [(2, True), (99, True), (2, False)])
def test_a_busy_api_delays_a_trial_whose_tags_this_process_has_not_seen_and_does_not_fail_it(
        monkeypatch, busy_for: int, up: bool) -> None:  # noqa: ANN001
    """Seen in a 2-node job of 100,000 trials (16 threads, one SQLite server): the API answered 503 past
    Prefect's client's own retries to a worker that had no answer yet for the trials' tags, and 3 trials
    failed before they ran. Now, while the API is up (its /health answers), the trial asks again, backing off,
    for up to `patience` seconds; an API that is down fails it at once, as before (nothing to wait for)."""
    import uuid

    import anyio
    import httpx
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    from hpc_garage import compat
    from hpc_garage.prefect.outage import is_outage_error

    cls = services.ConcurrencySlotAcquisitionWithLeaseService
    asked: list[float] = []

    async def own(self, slots, mode, timeout_seconds=None, max_retries=None, lease_duration=300,  # noqa: ANN001
                  strict=False, holder=None) -> httpx.Response:
        asked.append(anyio.current_time())
        request = httpx.Request("POST", "http://api/v2/concurrency_limits/increment-with-lease")
        if len(asked) <= busy_for:
            response = httpx.Response(503, request=request)
            raise httpx.HTTPStatusError("503 Service Unavailable", request=request, response=response)
        return httpx.Response(200, json={"lease_id": str(uuid.uuid4()), "limits": []}, request=request)

    monkeypatch.setattr(cls, "acquire", own)  # Prefect's, as the API would answer it; restored after

    @contextlib.asynccontextmanager
    async def no_client(self):  # noqa: ANN001, ANN202 - `own` needs none; Prefect's client started Prefect's
        yield                   # ephemeral server here, which outlived the test run (a uvicorn process a run)

    monkeypatch.setattr(cls, "_lifespan", no_client)
    monkeypatch.setattr(cls, "_hpc_garage_survives", False, raising=False)
    said: list[str] = []
    assert compat.tag_limits_survive_outages(is_outage_error, lambda: up, said.append, patience=4.0) is True
    service = cls.instance(frozenset(["tag:busy-test"]))
    holder = ConcurrencyLeaseHolder(type="task_run", id=uuid.uuid4())

    async def acquire() -> httpx.Response:
        return await cls.acquire(service, 1, "concurrency", None, None, 60, False, holder)

    if not up:  # down: Prefect's error at once, the trial not held
        with pytest.raises(httpx.HTTPStatusError):
            anyio.run(acquire)
        assert len(asked) == 1 and said == []
    elif busy_for == 2:  # asked three times, 1 s then 2 s apart: the answer, and the trial runs
        assert anyio.run(acquire).json()["limits"] == [] and len(asked) == 3
        assert [round(b - a) for a, b in zip(asked, asked[1:])] == [1, 2]
        assert said and "the trial waits for its answer (<= 4 s)" in said[0]
    else:  # busy past its patience (the next ask, 4 s later, would be past it): Prefect's error stands
        with pytest.raises(httpx.HTTPStatusError):
            anyio.run(acquire)
        assert [round(b - a) for a, b in zip(asked, asked[1:])] == [1, 2]
