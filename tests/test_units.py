import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_garage.core.units import format_bytes, format_walltime, parse_memory, parse_walltime


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


# ---- the contract (issue 14): every input is accepted with its documented meaning, or refused with one line


@pytest.mark.parametrize("bad", ["90.0", "25:99:00", "1:99:00", "1:30:60", "2-24", "0:0:0", "0.5s", "1e400s",
                                 "99999999999999999999"])
def test_ambiguous_or_impossible_walltimes_are_refused(bad: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_walltime(bad)
    assert bad in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("bad", "bare"), [("1e400", "MiB"), ("1e12", None), ("64e9", None), ("1e18TB", "MiB"),
                                           ("inf", "MiB"), ("nan", None)])
def test_overflowing_or_unitless_memory_is_refused(bad: str, bare: str | None) -> None:
    with pytest.raises(ValueError) as caught:
        parse_memory(bad, bare=bare)
    assert "\n" not in str(caught.value)


UNIT_TEXT = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"\A-?[0-9]{0,25}(\.[0-9]{0,4})?([eE][+-]?[0-9]{1,4})?\s?([KMGTPkmgtp]i?[Bb]?|[Bb]|min|h|s|d)?\Z"),
    st.from_regex(r"\A([0-9]{1,3}-)?[0-9]{1,4}(:[0-9]{1,3}){0,3}\Z"),
    st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.booleans(),
)


@given(UNIT_TEXT, st.sampled_from(["MiB", None]))
def test_memory_parser_accepts_with_meaning_or_refuses_in_one_line(value: object, bare: str | None) -> None:
    try:
        size = parse_memory(value, bare=bare)  # type: ignore[arg-type]
    except ValueError as exc:
        assert "\n" not in str(exc) and str(exc)
    else:
        assert isinstance(size, int) and 0 <= size <= 2**60


@given(UNIT_TEXT)
def test_walltime_parser_accepts_with_meaning_or_refuses_in_one_line(value: object) -> None:
    try:
        seconds = parse_walltime(value)  # type: ignore[arg-type]
    except ValueError as exc:
        assert "\n" not in str(exc) and str(exc)
    else:
        assert isinstance(seconds, int) and 1 <= seconds <= 10 * 365 * 86400


@pytest.mark.parametrize(("n", "plain", "measured"), [
    (0, "0 B", "0 B"), (512, "512 B", "512 B"), (1536, "1.5 KiB", "1.5 KiB"), (2 * 2**30, "2 GiB", "2.0 GiB"),
    (int(1.25 * 2**30), "1.2 GiB", "1.2 GiB"), (60 * 2**30, "60 GiB", "60.0 GiB"), (3 * 2**40, "3 TiB", "3.0 TiB")])
def test_sizes_read_as_people_write_them_and_measured_ones_keep_one_decimal(n: int, plain: str, measured: str) -> None:
    """Node memory reads `60 GiB`; a measured peak (the run's report, a trial's GPU memory) `60.0 GiB`."""
    assert format_bytes(n) == plain
    assert format_bytes(n, tenths=True) == measured


@given(st.integers(min_value=0, max_value=2**50))
def test_a_size_reads_back_within_its_rounding(n: int) -> None:
    for text in (format_bytes(n), format_bytes(n, tenths=True)):
        assert abs(parse_memory(text.replace(" ", "")) - n) <= max(0.05 * n, 1), text
