"""`dask-resource:` tags: building, parsing, and refusing what Dask would misplace."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import hpc_garage
from hpc_garage.core.errors import UserError
from hpc_garage.prefect.tags import resource_tags, resources_from_tags

amounts = st.one_of(st.integers(0, 10**6), st.floats(0, 1e6, allow_nan=False, allow_infinity=False))


@given(gpu=amounts, cpu=amounts, memory=st.integers(0, 2**50), process=amounts)
def test_round_trip(gpu: float, cpu: float, memory: int, process: float) -> None:
    asked = {"GPU": gpu, "CPU": cpu, "MEMORY": memory, "PROCESS": process}
    tags = resource_tags(gpu=gpu, cpu=cpu, memory=memory, process=process)
    assert resources_from_tags(tags) == {k: v for k, v in asked.items() if v}
    assert all(t.startswith("dask-resource:") for t in tags)


@given(name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,15}", fullmatch=True), value=amounts)
def test_any_resource_name_parses(name: str, value: float) -> None:
    assert resources_from_tags([f"dask-resource:{name}={value!r}"]) == {name: float(value)}


def test_the_guides_four_tags() -> None:
    tags = ["dask-resource:PROCESS=1", "dask-resource:MEMORY=10e9", "dask-resource:GPU=1", "dask-resource:CPU=18"]
    assert resources_from_tags(tags) == {"PROCESS": 1, "MEMORY": 10e9, "GPU": 1, "CPU": 18}


def test_spelling_of_built_tags() -> None:
    assert resource_tags(gpu=1, memory=10e9) == ["dask-resource:GPU=1", "dask-resource:MEMORY=10000000000"]
    assert resource_tags(cpu=0.5) == ["dask-resource:CPU=0.5"]
    assert resource_tags() == []
    assert hpc_garage.resources(gpu=1, cpu=18, memory="10GB", process=1) == [
        "dask-resource:GPU=1", "dask-resource:CPU=18", "dask-resource:MEMORY=10000000000", "dask-resource:PROCESS=1"]


@pytest.mark.parametrize(("memory", "size"), [("10GB", 10**10), ("10GiB", 10 * 2**30), ("10G", 10 * 2**30),
                                              (2**20, 2**20), (1.5e9, 1_500_000_000)])
def test_memory_units(memory: str | int | float, size: int) -> None:
    assert resources_from_tags(resource_tags(memory=memory)) == {"MEMORY": size}


def test_other_tags_are_ignored() -> None:
    assert resources_from_tags(["gpu-sweep", "dask", "dask-resource-GPU=1", "dask-resource:GPU=2"]) == {"GPU": 2}


@pytest.mark.parametrize("tag", ["dask-resource:GPU", "dask-resource:GPU=abc", "dask-resource:GPU=-1",
                                 "dask-resource:=1", "dask-resource:GPU=", "dask-resource:GPU=nan",
                                 "dask-resource:GPU=inf", "dask-resource:G PU=1"])
def test_malformed_tag_names_itself_and_the_form(tag: str) -> None:
    with pytest.raises(UserError) as caught:
        resources_from_tags(["ok", tag])
    assert repr(tag) in str(caught.value)
    assert "dask-resource:NAME=VALUE" in str(caught.value)


def test_conflicting_amounts_are_refused() -> None:
    with pytest.raises(UserError, match="GPU=1.*GPU=2|GPU=2.*GPU=1"):
        resources_from_tags(["dask-resource:GPU=1", "dask-resource:GPU=2"])
    assert resources_from_tags(["dask-resource:GPU=1", "dask-resource:GPU=1.0"]) == {"GPU": 1}


@pytest.mark.parametrize("kwargs", [{"gpu": -1}, {"cpu": float("nan")}, {"process": True}, {"memory": "10"},
                                    {"memory": "lots"}, {"memory": -5}])
def test_bad_amounts_are_user_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(UserError, match=next(iter(kwargs))):
        resource_tags(**kwargs)  # type: ignore[arg-type]
