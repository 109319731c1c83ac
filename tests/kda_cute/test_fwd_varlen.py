"""kda_cute_fwd's packed-o build (`table`, `T_raw`: o written straight onto the packed row through
the chunk table), its sm_90a PTX interpreted on CPU (ptxsim, as tests/kda_cute/test_scan_ptx.py),
and its host checks.

The packed row here has sequences of 1, 63, 0, 64, 65, 200 and 0 tokens (a 0-token one walks no
chunk, the last one from past the table's end; 65 and 200 end in a partial chunk after full
ones, 200 wraps the 2-stage ring and both o buffers), laid out with unwritten gaps between them
and after the last (rows no sequence owns), and `GUARD` NaN rows before and after o. The packed
build's o must be, bit for bit, the padded-row build's (the same `chunks`, no `table`) valid rows
gathered through the table, every other row still its NaN poison: a 64-row store of a partial
chunk would write the next gap's (or the next sequence's) rows, a store at the padded row's
offset the wrong rows (both caught: the predicate dropped, or a TMA box for every chunk, fail
the comparison). ~25 s per case on one CPU core.
"""

import pytest
import torch

pytest.importorskip("cutlass.cute")
pytest.importorskip("kda_cute.fwd")
from kda_chain.varlen import chunks_words  # noqa: E402
from kda_cute import fwd  # noqa: E402
from ptxsim import kda  # noqa: E402

LENGTHS = (1, 63, 0, 64, 65, 200, 0)
GAP = 3  # unwritten rows between two sequences (and after the last) on the packed row
GUARD = 64  # NaN rows before and after o in the emulated memory


def _packing(lengths=LENGTHS, gap=GAP):
    """(chunks int32 [2, N + 1], table int32 [T_pad / 64, 2], T_raw): each sequence's chunks on the
    padded row, per padded chunk its first packed row and valid rows; sequence s starts `gap`
    rows after the previous one's end."""
    table, start = [], 0
    for n in lengths:
        for j in range(0, n, 64):
            table.append((start + j, min(64, n - j)))
        start += n + gap
    chunks = torch.tensor(chunks_words([-(-n // 64) for n in lengths]), dtype=torch.int32).view(2, -1)
    return chunks, torch.tensor(table, dtype=torch.int32), start


def _gathered(o_pad, table, T_raw, guard):
    """The padded row's o [1, T_pad, HV, V] moved onto the packed row as the table says, in a
    NaN buffer with `guard` rows before and after (what the packed build must write)."""
    out = torch.full((1, guard + T_raw + guard, *o_pad.shape[2:]), float("nan"), dtype=o_pad.dtype)
    for j, (p0, nv) in enumerate(table.tolist()):
        out[0, guard + p0:guard + p0 + nv] = o_pad[0, 64 * j:64 * j + nv]
    return out


def _bits(x):
    return x.view(torch.int16)


@pytest.fixture
def sm90a(monkeypatch):
    """Compile for sm_90a (also on a GPU machine, whose default arch is its own)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


@pytest.mark.parametrize("HV, V, nwg, state", [(2, 64, 1, True), (1, 128, 2, False)])
def test_fwd_ptx_packed_o(sm90a, HV, V, nwg, state):
    """The packed-o build's PTX, interpreted on every CTA: o's valid rows bit for bit the
    padded-row build's gathered, every other row of o (the gaps, the tail) and the guard rows
    around it never written; ht bit for bit the padded-row build's. (2, 64, 1): GVA, h0 / ht,
    one warpgroup; (1, 128, 2): two warpgroups (the second one's tiles and rows)."""
    chunks, table, T_raw = _packing()
    T = 64 * table.shape[0]
    kg, w, u, gk = kda.scan_inputs(B=1, T=T, H=1, HV=HV, V=V)
    _, qg, Aqk = kda.q_and_aqk(1, T, HV, gk)
    h0 = torch.randn(chunks.numel() - 1, HV, 128, V, generator=torch.Generator().manual_seed(3)) * 0.1
    h0 = h0 if state else None
    got = kda.emulate_fwd(qg, kg, w, u, gk, Aqk, 0.088, 2, nwg, h0=h0, chunks=chunks, table=table,
                          T_raw=T_raw, guard=GUARD)
    want = kda.emulate_fwd(qg, kg, w, u, gk, Aqk, 0.088, 2, nwg, h0=h0, chunks=chunks)
    if state:
        (got, ht), (want, want_ht) = got, want
        assert torch.equal(ht, want_ht)
    assert torch.isfinite(want.float()).all()
    assert torch.equal(_bits(got), _bits(_gathered(want, table, T_raw, GUARD)))


# ------------------------------------------------------------------------------- host checks
def _call(T_pad=128, B=1):
    kg, w, u, gk = kda.scan_inputs(B=B, T=T_pad, H=1, HV=1, V=64)
    _, qg, Aqk = kda.q_and_aqk(B, T_pad, 1, gk)
    return (None, qg, kg, w, u, gk, Aqk)


def _reason(chunks, **kw):
    return fwd.static_reason(*_call(), None, chunks, **kw)


CHUNKS = torch.tensor(chunks_words([1, 1]), dtype=torch.int32).view(2, -1)
TABLE = torch.tensor([[0, 64], [64, 10]], dtype=torch.int32)


def test_packed_o_accepts_a_good_table():
    assert _reason(CHUNKS, table=TABLE, T_raw=74) is None
    assert _reason(CHUNKS, table=TABLE, T_raw=128) is None  # up to T_pad


@pytest.mark.parametrize("table, T_raw, words", [
    (TABLE.long(), 74, "int32"),
    (torch.zeros(3, 2, dtype=torch.int32), 74, "[NT, 2] = (2, 2)"),
    (torch.zeros(2, 3, dtype=torch.int32), 74, "[NT, 2]"),
    (torch.zeros(2, 2, 2, dtype=torch.int32), 74, "[NT, 2]"),
    (torch.zeros(2, 2, dtype=torch.int32).T, 74, "contiguous"),
    (torch.zeros(2, 2, dtype=torch.int32, device="meta"), 74, "table on meta"),
    ("table", 74, "table must be int32"),
    (TABLE, None, "T_raw"),
    (TABLE, 74.0, "T_raw"),
    (TABLE, True, "T_raw"),
    (TABLE, 0, "T_raw"),
    (TABLE, 129, "T_raw"),
])
def test_packed_o_bad_table_or_T_raw(table, T_raw, words):
    """A bad table (dtype, shape [T_pad / 64, 2], layout, device) or T_raw (not an int in
    1..T_pad) is refused with a one-line reason, before anything is compiled."""
    r = _reason(CHUNKS, table=table, T_raw=T_raw)
    assert r is not None and words in r and "\n" not in r, r


def test_packed_o_needs_chunks_and_one_row():
    assert "needs chunks" in _reason(None, table=TABLE, T_raw=74)
    assert "T_raw without a table" in _reason(None, T_raw=74)
    four = torch.tensor(chunks_words([1] * 4), dtype=torch.int32).view(2, -1)
    assert "[1, T" in fwd.static_reason(*_call(B=2), None, four, table=TABLE, T_raw=74)


def test_fwd_scan_raises_on_a_bad_table():
    with pytest.raises(ValueError, match="T_raw"):
        fwd.fwd_scan(*_call(), None, False, None, CHUNKS, table=TABLE, T_raw=1000)
