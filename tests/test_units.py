"""Units: sizes, rates and durations mean what they say (case-sensitive SI and IEC spellings, bits
apart from bytes, ambiguous spellings refused with what they could mean)."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from expertcache.errors import ExpertcacheError
from expertcache.units import (
    BIT_UNITS,
    BYTE_UNITS,
    capacity_for,
    format_bytes,
    parse_duration,
    parse_rate,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1234B", 1234),
        (1234, 1234),
        (2.5, 2.5),
        ("500MB", 500 * 10**6),
        ("500 MB", 500 * 10**6),
        ("6GiB", 6 * 2**30),
        ("1.5KiB", 1536),
        ("2kB", 2000),
        ("1TB", 10**12),
        ("0", 0),
        ("12B", 12),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text", ["12 parsecs", "", "GB", "-5MB", "1e9", "inf", "nan", "1,000", "5 G B", True]
)
def test_parse_size_rejects(text):
    with pytest.raises(ExpertcacheError, match="size"):
        parse_size(text)


def test_parse_rate_and_duration():
    assert parse_rate("16GB/s") == 16e9
    assert parse_rate("500MiB/s") == 500 * 2**20
    assert parse_rate(1e6) == 1e6
    assert parse_rate("2048B/s") == 2048
    for bad in ("0GB/s", "0", "fast", "-1GB/s", "GB/s", "2048", "inf"):
        with pytest.raises(ExpertcacheError, match="bandwidth"):
            parse_rate(bad)
    assert parse_duration("20us") == pytest.approx(20e-6)
    assert parse_duration("20µs") == pytest.approx(20e-6)
    assert parse_duration("1.5ms") == pytest.approx(1.5e-3)
    assert parse_duration("0.01s") == pytest.approx(0.01)
    assert parse_duration("7ns") == pytest.approx(7e-9)
    assert parse_duration(0.25) == 0.25
    assert parse_duration("0") == 0
    for bad in ("soon", "-1ms", "1 hour", "", "-5", "1m", "20MS"):
        with pytest.raises(ExpertcacheError, match="latency"):
            parse_duration(bad)


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (parse_duration, "20", "latency '20' needs a unit: 20us, 20ms or 20s"),
        (parse_duration, "1.5", "needs a unit: 1.5us, 1.5ms or 1.5s"),
        (parse_rate, "16", "bandwidth '16' needs a unit: 16GB/s or 16MB/s"),
        (parse_rate, "16GB", "bandwidth '16GB' is a size, not a rate: write 16GB/s"),
        (parse_size, "500", "size '500' needs a unit: 500B, 500MB or 500GiB"),
        (parse_size, "-5MB", "size '-5MB' must be a non-negative size"),
        (parse_duration, "-1ms", "must be a non-negative duration"),
    ],
)
def test_bare_numbers_need_a_unit(parse, text, message):
    """Text without a unit is refused (20 seconds of latency is too easy to mean 20us); 0 needs none,
    and Python numbers are in base units (bytes, seconds, bytes per second)."""
    with pytest.raises(ExpertcacheError, match=re.escape(message)):
        parse(text)
    assert parse_duration("0") == parse_size("0") == 0
    assert parse_duration(20) == 20 and parse_size(500) == 500 and parse_rate(16) == 16


def test_bits_are_not_bytes():
    """A link given in gigabits is an eighth as fast as one in gigabytes (it was read as GB/s)."""
    assert parse_rate("2Gb/s") == 0.25e9
    assert parse_rate("8Gbit/s") == parse_rate("1GB/s") == 1e9
    assert parse_rate("64Gib/s") == 8 * 2**30
    assert parse_rate("2GB/s") == 8 * parse_rate("2Gb/s")
    with pytest.raises(
        ExpertcacheError, match=re.escape("'8Gb' is in bits (10^9 bits); give memory in bytes: 8GB")
    ):
        parse_size("8Gb")


@pytest.mark.parametrize(
    ("parse", "text", "could_mean"),
    [
        (parse_size, "5m", ["5MB", "5MiB"]),
        (parse_size, "5mb", ["5MB", "5MiB"]),
        (parse_size, "6g", ["6GB", "6GiB"]),
        (parse_size, "2KB", ["2kB", "2KiB"]),
        (parse_size, "1gib", ["1GiB"]),
        (parse_size, "5ms", ["5MiB"]),
        (parse_rate, "2gb/s", ["2GB/s", "2Gb/s", "2GiB/s"]),
        (parse_rate, "5m/s", ["5MB/s", "5Mb/s"]),
        (parse_rate, "1mB/s", ["1MB/s", "1MiB/s"]),
    ],
)
def test_ambiguous_units_are_refused_with_what_they_could_mean(parse, text, could_mean):
    # one spelling it could mean is named alone ("ambiguous; write  or 5MiB" was printed)
    words = "ambiguous" if len(could_mean) > 1 else f"is not one this reads.*; write {could_mean[0]} "
    with pytest.raises(ExpertcacheError, match=words) as err:
        parse(text)
    assert all(c in str(err.value) for c in could_mean) and "write  or" not in str(err.value), str(err.value)


_NUMBERS = st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False).map(
    lambda d: f"{d.normalize():f}"
)


@given(number=_NUMBERS, unit=st.sampled_from(sorted(BYTE_UNITS)))
def test_every_size_unit_means_its_table_entry(number, unit):
    assert parse_size(f"{number}{unit}") == pytest.approx(float(number) * BYTE_UNITS[unit])
    if float(number) > 0:
        assert parse_rate(f"{number}{unit}/s") == parse_size(f"{number}{unit}")


@given(number=_NUMBERS.filter(lambda n: float(n) > 0), unit=st.sampled_from(sorted(BIT_UNITS)))
def test_every_bit_unit_is_an_eighth_of_its_byte_unit(number, unit):
    byte = unit.removesuffix("bit").removesuffix("b") + "B"
    assert parse_rate(f"{number}{unit}/s") == pytest.approx(parse_rate(f"{number}{byte}/s") / 8)
    with pytest.raises(ExpertcacheError, match="in bits"):
        parse_size(f"{number}{unit}")


@given(
    number=_NUMBERS.filter(lambda n: float(n) > 0),
    unit=st.sampled_from(sorted({*BYTE_UNITS, *BIT_UNITS})),
    flips=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_a_spelling_outside_the_table_is_never_read(number, unit, flips):
    """Change the case of any letters of a unit: the result is the table's entry for that exact
    spelling, or a refusal; never another unit's value."""
    spelled = "".join(c.swapcase() if i < len(flips) and flips[i] else c for i, c in enumerate(unit))
    table = {**BYTE_UNITS, **BIT_UNITS}
    try:
        got = parse_rate(f"{number}{spelled}/s")
    except ExpertcacheError as err:
        assert spelled not in table, str(err)
    else:
        assert spelled in table and got == pytest.approx(float(number) * table[spelled])


@given(st.integers(0, 2**50))
def test_format_bytes_reads_back(n):
    text = format_bytes(n).replace(" ", "")
    assert parse_size(text) == pytest.approx(n, rel=0.06, abs=1)


def test_capacity_for():
    assert capacity_for(1000, 100, 50) == 10
    assert capacity_for(1099, 100, 50) == 10
    assert capacity_for("1KiB", 100, 50) == 10
    assert capacity_for(10**9, 100, 50) == 50
    assert capacity_for(99, 100, 50) == 0
    assert capacity_for("30%", 100, 50) == 15
    assert capacity_for("33%", 100, 10) == 3
    assert capacity_for(" 100% ", 100, 7) == 7
    assert capacity_for("0.1%", 100, 50) == 0
    for total in range(1, 40):
        for p in (10, 12.5, 20, 25, 30, 40, 50, 60, 70, 75, 80, 90, 100):
            assert capacity_for(f"{p}%", 64, total) == math.floor(total * p / 100 + 1e-9)
    for bad, msg in [("150%", "share"), ("0%", "share"), ("-3%", "share"), ("x%", "percentage")]:
        with pytest.raises(ExpertcacheError, match=msg):
            capacity_for(bad, 100, 50)
    # a percentage's number is written as a size's: Python's float also read these (a new user's trial:
    # "--host-memory 1e-9%" was a percentage where "1e7B" is not a size; "5_0%" read as 50 %)
    from expertcache.config import HostConfig

    for bad in ("1e-9%", "5_0%", "inf%", "nan%"):
        with pytest.raises(ExpertcacheError, match="is not a percentage"):
            capacity_for(bad, 100, 50)
        with pytest.raises(ExpertcacheError, match=f"host memory '{bad}' is not a percentage"):
            HostConfig(bad)
    with pytest.raises(ExpertcacheError, match="unknown unit 'parsecs'"):
        capacity_for("12 parsecs", 100, 50)
