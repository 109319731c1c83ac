"""The three scans' sm_90a PTX (kda_cute_b1, kda_cute_fwd, kda_cute_dhu), run on CPU by a PTX
interpreter, compute their contracts against float64 (CI, no GPU).

The interpreter is ptxsim (tools/ptxsim): its base CTA (one Python generator per thread) extended
by `ptxsim.hopper.HopperCTA` with what the scans use: TMA tiles (cp.async.bulk.tensor with 128-byte
swizzle, loads completing an mbarrier's transaction count, stores), mbarriers (init, arrive,
expect_tx, try_wait.parity as a spin that yields), elect.sync, named barriers, and warpgroup MMAs
(wgmma.mma_async m64nNk16, A from registers or from a shared-memory descriptor, B from a
descriptor, K- or MN-major, run as a 128-thread collective). The tensor maps are built on the host
at launch, which a CPU cannot do, so `ptxsim.kda` describes each one itself (tensor, coordinate
order, box, swizzle) from the kernel's argument order. TMA loads run at issue (the earliest: a
refill that lands on a stage still in use corrupts it). TMA stores read their shared-memory
source, and wgmma groups their registers and shared memory, only when a wait_group lets them
complete (the latest the hardware may), so an operand overwritten before its wait gives wrong
output (removing b1's store read wait before the named barrier: h 1.4 relative error). So this
checks the kernel's logic (indices, buffers, barrier phases, the accumulator-to-A view, the
waits), not every possible race.
"""

import pytest
import torch

pytest.importorskip("cutlass.cute")
pytest.importorskip("kda_cute.b1")
pytest.importorskip("kda_cute.fwd")
pytest.importorskip("kda_cute.dhu")
from kda_chain.varlen import chunks_words  # noqa: E402
from kda_cute import reference as ref  # noqa: E402
from kda_cute.reference import stages as rstages  # noqa: E402
from ptxsim import kda  # noqa: E402


@pytest.fixture
def sm90a(monkeypatch):
    """Compile for sm_90a (also on a GPU machine, whose default arch is its own)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


# (B, T, H, HV, V, stages, warpgroups): a full + a ragged chunk; GVA with two warpgroups and a
# four-chunk ragged T; one chunk at three stages; two sequences; the one-wave build (4 stages x 1
# warpgroup, `b1.variant` under one wave of SMs) over six ragged chunks, so the ring wraps. ~10 s
# each on one CPU core.
CASES = [
    (1, 96, 1, 1, 64, 2, 1),
    (1, 200, 1, 2, 128, 2, 2),
    (1, 64, 2, 2, 64, 3, 1),
    (2, 130, 1, 1, 128, 2, 2),
    (1, 330, 1, 1, 64, 4, 1),
]


@pytest.mark.parametrize("B, T, H, HV, V, stages, nwg", CASES)
def test_b1_ptx_computes_fwd_h(sm90a, B, T, H, HV, V, stages, nwg):
    """b1's sm_90a PTX, interpreted on CPU for every CTA: h and v_new match the float64
    reference to bf16 accuracy (measured 1.4e-3..2.7e-3; a wrong index, buffer or phase is O(1)
    off or leaves the NaN poison), every element written."""
    kg, w, u, gk = kda.scan_inputs(B=B, T=T, H=H, HV=HV, V=V)
    h, v_new = kda.emulate_b1(kg, w, u, gk, stages, nwg)
    want_h, want_v, _ = rstages.fwd_h(kg.double(), w.double(), u.double(), gk.double(), None, False)
    _assert_matches((h, v_new), (want_h, want_v))


def _assert_matches(got, want, tol=5e-3):
    """Every output finite (no NaN poison left) and within `tol` of its float64 reference."""
    for x, exp in zip(got, want, strict=True):
        assert torch.isfinite(x.float()).all()
        assert ref.rel_err(x.double(), exp) < tol, ref.rel_err(x.double(), exp)


@pytest.mark.parametrize("B, T, HV, V, stages, nwg", [(1, 96, 1, 64, 2, 1), (1, 200, 2, 128, 1, 2)])
def test_fwd_ptx_computes_fwd_scan(sm90a, B, T, HV, V, stages, nwg):
    """kda_cute_fwd's PTX (A operands from shared memory, both majors), interpreted: o matches
    float64 to bf16 accuracy (measured 2.0e-3 / 2.7e-3)."""
    kg, w, u, gk = kda.scan_inputs(B=B, T=T, H=HV, HV=HV, V=V)
    q, qg, Aqk = kda.q_and_aqk(B, T, HV, gk)
    o = kda.emulate_fwd(qg, kg, w, u, gk, Aqk, 0.088, stages, nwg)
    want, _ = rstages.fwd_scan(q.double(), None, kg.double(), w.double(), u.double(), gk.double(),
                               Aqk.double(), None, False, 0.088)
    _assert_matches((o,), (want,))


@pytest.mark.parametrize("B, T, HV, V, stages, nwg", [(1, 96, 1, 64, 2, 1), (1, 200, 2, 128, 1, 2)])
def test_dhu_ptx_computes_bwd_dhu(sm90a, B, T, HV, V, stages, nwg):
    """kda_cute_dhu's PTX (the reverse scan, dv = tril(Aqk)^T do inside; Aqk's upper triangle is
    garbage, which the kernel must mask), interpreted: dh and dv2 match float64 to bf16 accuracy."""
    kg, w, u, gk = kda.scan_inputs(B=B, T=T, H=HV, HV=HV, V=V)
    _, qg, Aqk = kda.q_and_aqk(B, T, HV, gk)
    do = kda.upstream_do(B, T, HV, V, torch.Generator().manual_seed(2))
    dh, dv2 = kda.emulate_dhu(qg, kg, w, gk, do, Aqk, 0.088, stages, nwg)
    want_dh, _, want_dv2 = rstages.bwd_dhu(qg.double(), kg.double(), w.double(), gk.double(), None, None,
                                           do.double(), None, 0.088, Aqk.double())
    _assert_matches((dh, dv2), (want_dh, want_dv2))


@pytest.mark.parametrize("stages, nwg, V", [(2, 1, 64), (2, 2, 128)])
def test_fwd_ptx_with_initial_and_final_state(sm90a, stages, nwg, V):
    """fwd with h0 read and ht written (fp32, through ld / st.global): o and ht match float64
    (T = 96, one and two warpgroups)."""
    kg, w, u, gk = kda.scan_inputs(B=1, T=96, H=1, HV=1, V=V)
    q, qg, Aqk = kda.q_and_aqk(1, 96, 1, gk)
    h0 = torch.randn(1, 1, 128, V, generator=torch.Generator().manual_seed(5)) * 0.1
    o, ht = kda.emulate_fwd(qg, kg, w, u, gk, Aqk, 0.088, stages, nwg, h0=h0)
    want = rstages.fwd_scan(q.double(), None, kg.double(), w.double(), u.double(), gk.double(),
                            Aqk.double(), h0.double(), True, 0.088)
    _assert_matches((o, ht), want)


@pytest.mark.parametrize("stages, nwg, V", [(2, 1, 64), (2, 2, 128)])
def test_dhu_ptx_with_dht_and_dh0(sm90a, stages, nwg, V):
    """dhu with dht read and dh0 written (fp32, through ld / st.global): dh, dv2 and dh0 match
    float64 (T = 96, one and two warpgroups)."""
    kg, w, u, gk = kda.scan_inputs(B=1, T=96, H=1, HV=1, V=V)
    _, qg, Aqk = kda.q_and_aqk(1, 96, 1, gk)
    g = torch.Generator().manual_seed(4)
    do = kda.upstream_do(1, 96, 1, V, g)
    dht = torch.randn(1, 1, 128, V, generator=g) * 0.1
    dh, dv2, dh0 = kda.emulate_dhu(qg, kg, w, gk, do, Aqk, 0.088, stages, nwg, dht=dht)
    h0 = torch.zeros(1, 1, 128, V, dtype=torch.float64)
    want = rstages.bwd_dhu(qg.double(), kg.double(), w.double(), gk.double(), h0, dht.double(),
                           do.double(), None, 0.088, Aqk.double())
    _assert_matches((dh, dh0, dv2), want)


@pytest.mark.parametrize("stages, nwg, V", [(2, 1, 64), (2, 2, 128)])
def test_b1_ptx_with_initial_and_final_state(sm90a, stages, nwg, V):
    """b1 with h0 read and ht written (fp32, through ld / st.global): h, v_new and ht match
    float64 (T = 96, one and two warpgroups)."""
    kg, w, u, gk = kda.scan_inputs(B=1, T=96, H=1, HV=1, V=V)
    h0 = torch.randn(1, 1, 128, V, generator=torch.Generator().manual_seed(3)) * 0.1
    h, v_new, ht = kda.emulate_b1(kg, w, u, gk, stages, nwg, h0=h0)
    want = rstages.fwd_h(kg.double(), w.double(), u.double(), gk.double(), h0.double(), True)
    _assert_matches((h, v_new, ht), want)


# Packed sequences (the chunk table): N = 4 sequences of 1, 0, 2 and 3 chunks on one [1, 384] row,
# one CTA per (V tile, head, sequence). The empty one runs no chunk (its state passes through
# untouched), the 3-chunk one wraps the 2-stage ring, and every load / store but the first
# sequence's sits at a chunk offset c0 > 0 of the row. The walk order (longest first: 3, 2, 0, 1)
# is not the sequence order, so CTA row z reads and writes the rows of sequence PACKED[1, z].
PACKED = torch.tensor(chunks_words([1, 0, 2, 3]), dtype=torch.int32).view(2, -1)
PACKED_T = 64 * 6


def _states(V, HV, seed):
    """Per-sequence fp32 states [N, HV, 128, V] (h0 or dht)."""
    return torch.randn(PACKED.shape[1] - 1, HV, 128, V, generator=torch.Generator().manual_seed(seed)) * 0.1


def _assert_passes_through(got, state):
    """The empty sequence (the table's second) leaves its state bitwise unchanged."""
    assert torch.equal(got[1], state[1])


@pytest.mark.parametrize("HV, V, nwg", [(2, 128, 2), (1, 64, 1)])
def test_b1_ptx_packed_sequences(sm90a, HV, V, nwg):
    """b1 with a chunk table and per-sequence h0 / ht: h, v_new and ht match the float64
    reference run per sequence (`chunks=`), so CTA row z walks the chunks [chunks[0, s],
    chunks[0, s + 1]) of its sequence s = chunks[1, z] from h0 row s and writes ht row s; the
    0-chunk sequence's ht is its h0 exactly. (2, 128, 2): GVA (one k head for two value heads),
    two warpgroups."""
    kg, w, u, gk = kda.scan_inputs(B=1, T=PACKED_T, H=1, HV=HV, V=V)
    h0 = _states(V, HV, 6)
    h, v_new, ht = kda.emulate_b1(kg, w, u, gk, 2, nwg, h0=h0, chunks=PACKED)
    want = rstages.fwd_h(kg.double(), w.double(), u.double(), gk.double(), h0.double(), True, chunks=PACKED)
    _assert_matches((h, v_new, ht), want)
    _assert_passes_through(ht, h0)


def test_fwd_ptx_packed_sequences(sm90a):
    """fwd with a chunk table and per-sequence h0 / ht (GVA: HV = 2 over one k head, V = 64, one
    warpgroup): o and ht match the float64 reference run per sequence; the 0-chunk sequence's
    ht is its h0 exactly."""
    HV, V = 2, 64
    kg, w, u, gk = kda.scan_inputs(B=1, T=PACKED_T, H=1, HV=HV, V=V)
    q, qg, Aqk = kda.q_and_aqk(1, PACKED_T, HV, gk)
    h0 = _states(V, HV, 7)
    o, ht = kda.emulate_fwd(qg, kg, w, u, gk, Aqk, 0.088, 2, 1, h0=h0, chunks=PACKED)
    want = rstages.fwd_scan(q.double(), None, kg.double(), w.double(), u.double(), gk.double(),
                            Aqk.double(), h0.double(), True, 0.088, chunks=PACKED)
    _assert_matches((o, ht), want)
    _assert_passes_through(ht, h0)


def test_dhu_ptx_packed_sequences(sm90a):
    """dhu with a chunk table and per-sequence dht / dh0 (V = 128, two warpgroups): each CTA runs
    its sequence's chunks last to first from its dht row; dh, dv2 and dh0 match the float64
    reference run per sequence; the 0-chunk sequence's dh0 is its dht exactly."""
    HV, V = 1, 128
    kg, w, u, gk = kda.scan_inputs(B=1, T=PACKED_T, H=HV, HV=HV, V=V)
    _, qg, Aqk = kda.q_and_aqk(1, PACKED_T, HV, gk)
    do = kda.upstream_do(1, PACKED_T, HV, V, torch.Generator().manual_seed(8))
    dht = _states(V, HV, 9)
    dh, dv2, dh0 = kda.emulate_dhu(qg, kg, w, gk, do, Aqk, 0.088, 2, 2, dht=dht, chunks=PACKED)
    h0 = torch.zeros(dht.shape, dtype=torch.float64)
    want = rstages.bwd_dhu(qg.double(), kg.double(), w.double(), gk.double(), h0, dht.double(),
                           do.double(), None, 0.088, Aqk.double(), chunks=PACKED)
    _assert_matches((dh, dh0, dv2), want)
    _assert_passes_through(dh0, dht)
