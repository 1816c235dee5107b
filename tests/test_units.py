import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_garage.core.units import format_walltime, parse_memory, parse_walltime


@pytest.mark.parametrize(
    "text, expected",
    [
        ("64GiB", 64 * 2**30),
        ("64GB", 64 * 10**9),
        ("64G", 64 * 2**30),  # sbatch --mem=64G is GiB
        ("2gb", 2 * 2**30),  # PBS mem=2gb is GiB
        ("4000", 4000 * 2**20),  # sbatch --mem=4000 is MiB
        ("1.5T", int(1.5 * 2**40)),
        ("512 MiB", 512 * 2**20),
        ("64e9", 64 * 10**9),
    ],
)
def test_memory_forms(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


def test_bare_memory_refused_where_a_unit_is_required() -> None:
    with pytest.raises(ValueError, match="no unit"):
        parse_memory("256", bare=None)


@pytest.mark.parametrize("bad", ["lots", "GB", "-5GB", ""])
def test_bad_memory(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_memory(bad, bare=None)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90 * 60),  # sbatch -t 90: minutes
        ("10:30", 630),  # MM:SS
        ("01:00:00", 3600),
        ("1-00:00:00", 86400),
        ("2-12", 2 * 86400 + 12 * 3600),
        ("1-02:30", 86400 + 2 * 3600 + 30 * 60),
        ("2h", 7200),
        ("90min", 5400),
    ],
)
def test_walltime_forms(text: str, seconds: int) -> None:
    assert parse_walltime(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "0", "-1h", "1:2:3:4"])
def test_bad_walltime(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_walltime(bad)


@given(st.integers(min_value=1, max_value=10**7))
def test_walltime_round_trip(seconds: int) -> None:
    assert parse_walltime(format_walltime(seconds)) == seconds


@pytest.mark.parametrize("text", ["64GB", "64GiB", "512 MiB", "1.5 TB", "64e9", "100B", "2KiB", "3Gi", "7 kB", "1PiB"])
def test_units_agree_with_dask_where_scheduler_conventions_do_not_apply(text: str) -> None:
    from dask.utils import parse_bytes

    assert parse_memory(text) == int(parse_bytes(text))


def test_memory_parsing_does_not_import_dask() -> None:
    import subprocess
    import sys

    code = "import sys; from hpc_garage.core.units import parse_memory; parse_memory('64GiB'); print('dask' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
