"""kda_cute_dhu's table build (packed sequences: do read straight from the packed row through the
padded row's chunk table) gives, bit for bit, the build without the table run on do gathered onto
the padded row with zero pad rows (CPU, the PTX interpreter; see test_scan_ptx.py).

Sequences of lengths 1, 0, 63, 64, 65 (the empty one runs no chunk: its dh0 is its dht; five
chunks on the padded row, T_pad = 320, valid rows 1, 63, 64, 64, 1). Every padded-row operand (qg,
kg, w, gk, Aqk) is random on every row, the pad rows included, so a pad row of do that is not an
exact +0 changes dh / dv2 (the chain's pad rows of qg are 0, which would hide it). The packed do:

  * `_gapped`: poison rows (NaN, +Inf, -Inf, -0 in turn) between the sequences, every partial
    chunk's box past its valid rows in poison but the last sequence's, flush with do's end (its
    box runs past the end: TMA's zero fill): a read of any row outside a chunk's valid ones
    shows as NaN;
  * `_contiguous`: the chain's packed row (kda_chain.varlen), where a partial chunk's box reads
    the next sequence's rows: zeroed in smem before the MMAs, or dh / dv2 differ.

~10-40 s per interpreted case on one core (the padded build is run once per (HV, V, nwg)).
"""

import functools

import pytest
import torch

pytest.importorskip("cutlass.cute")
D = pytest.importorskip("kda_cute.dhu")
from kda_chain.varlen import packing  # noqa: E402
from ptxsim import kda  # noqa: E402

pytestmark = pytest.mark.usefixtures("sm90a")

LENS = (1, 0, 63, 64, 65)
SCALE = 0.088
POISON = (float("nan"), float("inf"), float("-inf"), -0.0)
GAPS = (8, 63, 0, 16, 8)  # `_gapped`'s poison rows before each sequence


def _packing():
    off = [0]
    for n in LENS:
        off.append(off[-1] + n)
    return packing(torch.tensor(off, dtype=torch.int32), off)


P = _packing()
T_PAD, T_RAW = P.T_pad, P.T
SEQ_OF_CHUNK = torch.repeat_interleave(torch.arange(len(LENS)), (P.chunks[0, 1:] - P.chunks[0, :-1]).long())


@functools.cache
def _inputs(HV, V):
    """The padded-row operands (random on every row) and the packed do's valid rows."""
    kg, w, _, gk = kda.scan_inputs(B=1, T=T_PAD, H=1, HV=HV, V=V, seed=11)
    _, qg, Aqk = kda.q_and_aqk(1, T_PAD, HV, gk, seed=12)
    g = torch.Generator().manual_seed(13)
    do = kda.upstream_do(1, T_RAW, HV, V, g)
    dht = torch.randn(len(LENS), HV, 128, V, generator=g) * 0.1
    return (qg, kg, w, gk, Aqk), do, dht


def _contiguous(do):
    """The chain's packed row and its table."""
    return do, P.table


def _gapped(do):
    """do's sequences with poison rows between them (GAPS: before the first, then after each but
    the last, which is flush with the end; 63 after the 1-token one, so its chunk's whole box past
    the valid row is poison), and its table. T_raw = 288 <= T_pad."""
    HV, V = do.shape[2:]
    out = torch.empty(1, T_RAW + sum(GAPS), HV, V, dtype=do.dtype)
    rows = torch.arange(out.shape[1])
    for i, x in enumerate(POISON):
        out[0, rows % len(POISON) == i] = x
    shift = [sum(GAPS[: n + 1]) for n in range(len(LENS))]  # sequence n's rows move by this
    for n in range(len(LENS)):
        a, b = sum(LENS[:n]), sum(LENS[: n + 1])
        out[0, a + shift[n]:b + shift[n]] = do[0, a:b]
    table = P.table.clone()
    table[:, 0] += torch.tensor(shift, dtype=torch.int32)[SEQ_OF_CHUNK]
    return out, table


@functools.cache
def _padded_build(HV, V, nwg):
    """The build without the table on do gathered onto the padded row, zero pad rows."""
    ops, do, dht = _inputs(HV, V)
    do_p = torch.zeros(1, T_PAD, HV, V, dtype=do.dtype)
    do_p[0, P.index] = do[0]
    return kda.emulate_dhu(*ops[:4], do_p, ops[4], SCALE, 2, nwg, dht=dht, chunks=P.chunks)


def _bits(x):
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize("form", [_gapped, _contiguous])
@pytest.mark.parametrize("HV, V, nwg", [(2, 64, 1), (1, 128, 2)])
def test_table_build_is_the_padded_build(form, HV, V, nwg):
    """dh, dv2, dh0 of the table build bit for bit the padded build's (every CTA: one per V tile
    pair, head and sequence; (2, 64, 1): GVA, one warpgroup; (1, 128, 2): two warpgroups sharing
    the stage, each loading its own do tile at the row offset); the 0-length sequence's dh0 is its
    dht exactly."""
    ops, do, dht = _inputs(HV, V)
    do_raw, table = form(do)
    got = kda.emulate_dhu(*ops[:4], do_raw, ops[4], SCALE, 2, nwg, dht=dht, chunks=P.chunks, table=table)
    want = _padded_build(HV, V, nwg)
    for name, x, y in zip(("dh", "dv2", "dh0"), got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.isfinite(y.float()).all(), name  # (the padded build: every element written)
        assert torch.equal(_bits(x), _bits(y)), name
    assert torch.equal(got[2][1], dht[1])


def test_table_build_ptx():
    """The table build is its own kernel (the config's `table`), within registers: no local memory."""
    ops, do, dht = _inputs(2, 64)
    c = D.compile_for(*ops[:4], None, None, do, None, SCALE, ops[4], P.chunks, table=P.table)
    text = kda.ptx_text(c)
    entry = text.split(".entry", 1)[1]
    assert ".local" not in entry, "register arrays fell to local memory"


# ------------------------------------------------------------------------------------ host checks
def _call(**over):
    """hard_reason's answer for the table call with `over` replacing some of its arguments."""
    ops, do, _ = _inputs(2, 64)
    qg, kg, w, gk, Aqk = ops
    a = dict(qg=qg, kg=kg, w=w, gk=gk, h0=None, dht=None, do=do, dv=None, Aqk=Aqk, chunks=P.chunks,
             table=P.table)
    a.update(over)
    return D.hard_reason(**a)


def test_host_accepts_the_table_call():
    assert _call() is None
    assert _call(do=_gapped(_inputs(2, 64)[1])[0]) is None  # any T_raw up to T_pad
    assert _call(table=None, do=torch.zeros(1, T_PAD, 2, 64, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("what, over", [
    ("int64", dict(table=P.table.long())),
    ("shape [NT + 1, 2]", dict(table=torch.zeros(T_PAD // 64 + 1, 2, dtype=torch.int32))),
    ("shape [NT, 3]", dict(table=torch.zeros(T_PAD // 64, 3, dtype=torch.int32))),
    ("non-contiguous", dict(table=P.table.t().contiguous().t())),
    ("wrong device", dict(table=P.table.to("meta"))),
    ("no chunks", dict(chunks=None)),
    ("dv given", dict(dv=torch.zeros(1, T_PAD, 2, 64, dtype=torch.bfloat16))),
    ("do longer than the padded row", dict(do=torch.zeros(1, T_PAD + 1, 2, 64, dtype=torch.bfloat16))),
    ("do of batch 2", dict(do=torch.zeros(2, T_RAW, 2, 64, dtype=torch.bfloat16))),
    ("do 3-d", dict(do=torch.zeros(T_RAW, 2, 64, dtype=torch.bfloat16))),
    ("do's heads", dict(do=torch.zeros(1, T_RAW, 4, 64, dtype=torch.bfloat16))),
])
def test_host_refuses_a_bad_table_call(what, over):
    """A one-line reason for each bad table call."""
    r = _call(**over)
    assert isinstance(r, str) and r and "\n" not in r, what


def test_host_refuses_batch_two():
    ops, do, _ = _inputs(2, 64)
    qg2, kg2, w2, gk2, A2 = (torch.cat([x, x]) for x in ops)
    r = D.hard_reason(qg2, kg2, w2, gk2, None, None, do, None, A2, P.chunks, table=P.table)
    assert r and "padded row" in r


def test_bwd_dhu_raises_on_a_bad_table():
    ops, do, _ = _inputs(2, 64)
    with pytest.raises(ValueError, match="table"):
        D.bwd_dhu(*ops[:4], None, None, do, None, SCALE, ops[4], P.chunks, table=P.table.long())
