"""The range-name format is shared by the chain (writer) and the witness (reader): round-trip it."""

import pytest
from kda_witness import parse_stage_range, range_name, stage_range
from kda_witness.ranges import annotate


@pytest.mark.parametrize(
    "stage, impl, reason",
    [
        ("intra", "cute", None),
        ("dhu", "fla", "kernel not built yet"),
        ("intra", "fla", "cute: T % 64 != 0"),
        ("b1", "reference", "fla: no CUDA device; cute: a::b scoped name"),
    ],
)
def test_round_trip(stage, impl, reason):
    name = range_name(stage, impl, reason)
    assert name.startswith(f"kda::{stage}::{impl}")
    assert parse_stage_range(name) == (stage, impl, reason)
    assert stage_range(stage, impl, reason).name == name


def test_exact_format():
    assert range_name("intra", "cute") == "kda::intra::cute"
    assert range_name("dhu", "fla", "kernel not built yet") == "kda::dhu::fla::kernel not built yet"
    assert range_name("dhu", "fla", "") == "kda::dhu::fla"  # an empty reason is no reason


def test_reason_is_one_line():
    name = range_name("fwd", "fla", "line one\n  line two")
    assert parse_stage_range(name) == ("fwd", "fla", "line one line two")


@pytest.mark.parametrize("name", ["aten::mm", "kda::intra", "kda::::cute", "other::intra::cute", "kda", ""])
def test_not_a_stage_range(name):
    assert parse_stage_range(name) is None


@pytest.mark.parametrize("stage, impl", [("a::b", "cute"), ("intra", ""), ("", "fla")])
def test_bad_parts_rejected(stage, impl):
    with pytest.raises(ValueError):
        range_name(stage, impl)


def test_annotate_is_reentrant_decorator():
    """Each entry opens its own record_function: one object entered twice (nested) holds two open
    ranges, closed in order on exit; a recursing decorated function gets a fresh range per call."""
    from torch.profiler import profile

    @annotate("kda::rec::reference")
    def rec(n):
        return 0 if n == 0 else 1 + rec(n - 1)

    a = annotate("x")
    with profile() as prof:
        assert rec(3) == 3
        with a:
            with a:  # the same object entered twice, nested
                outer, inner = a._open.stack
                assert outer is not None and inner is not None and outer is not inner
            assert len(a._open.stack) == 1
    assert a._open.stack == []
    assert {"kda::rec::reference", "x"} <= {e.name for e in prof.events()}
