"""HopperCTA on hand-written PTX: an mbarrier-tracked TMA load with the 128-byte swizzle and an
out-of-bounds tail, a TMA store back, named barriers; a store never waited for and a transaction
count never met are caught; TensorMap drops static size-1 modes."""

import pytest
import torch
from ptxsim import (
    HopperCTA,
    InlineAsmProgram,
    TensorMap,
    global_memory,
    named_barriers,
    param_address,
    readback,
)

KERNEL = """
.version 8.0
.target sm_90a
.address_size 64

.visible .entry tma_copy(
    .param .align 64 .b8 tma_copy_param_0[128],
    .param .align 64 .b8 tma_copy_param_1[128],
    .param .align 8 .b8 tma_copy_param_2[8]
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<8>;

    mov.u32 %r1, %tid.x;
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra $L_init_done;
    mbarrier.init.shared::cta.b64 [__dynamic_shmem__0], 1;
$L_init_done:
    bar.sync 1, 64;
    @%p1 bra $L_wait;
    mov.u64 %rd1, tma_copy_param_0;
    mbarrier.arrive.expect_tx.shared::cta.b64 %rd2, [__dynamic_shmem__0], 1024;
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
        [__dynamic_shmem__0+1024], [%rd1, {0, 0}], [__dynamic_shmem__0];
$L_wait:
    {
    .reg .pred P1;
    LAB_WAIT:
    mbarrier.try_wait.parity.shared::cta.b64 P1, [__dynamic_shmem__0], 0;
    @!P1 bra LAB_WAIT;
    }
    setp.ge.u32 %p2, %r1, 8;
    @%p2 bra $L_store;
    shl.b32 %r2, %r1, 7;
    add.u32 %r3, %r2, 1024;
    ld.shared.u32 %r4, [%r3];          // the raw smem word at row tid, 16-byte chunk 0
    ld.param.u64 %rd3, [tma_copy_param_2];
    mul.wide.u32 %rd4, %r1, 4;
    add.s64 %rd5, %rd3, %rd4;
    st.global.u32 [%rd5], %r4;
$L_store:
    bar.sync 1, 64;
    @%p1 bra $L_end;
    mov.u64 %rd6, tma_copy_param_1;
    fence.proxy.async.shared::cta;
    cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd6, {0, 0}], [__dynamic_shmem__0+1024];
    cp.async.bulk.commit_group;
    cp.async.bulk.wait_group.read 0;
$L_end:
    ret;
}
"""


def _run(text):
    """src [6, 32] fp32 loaded as one (32, 8) box (rows 6, 7 out of bounds), stored to dst [8, 32];
    probe[t] = the shared word at byte 128 t of the box (t < 8)."""
    src = torch.arange(6 * 32, dtype=torch.float32).view(6, 32) + 1
    dst = torch.full((8, 32), float("nan"))
    probe = torch.full((8,), float("nan"))
    prog = named_barriers(InlineAsmProgram(text))
    gmem, (bs, bd, bp) = global_memory([src, dst, probe])
    tmas = {param_address(0): TensorMap(bs, (32, 6), (4, 128), (32, 8), 4, 128, (True, False)),
            param_address(1): TensorMap(bd, (32, 8), (4, 128), (32, 8), 4, 128, (True, False))}
    params = {("tma_copy_param_2", 0): bp}
    HopperCTA(prog, gmem, params, (0, 0, 0), 64, tmas).run()
    return src, readback(gmem, dst, bd), readback(gmem, probe, bp)


def test_tma_load_swizzles_and_zero_fills_and_the_store_undoes_it():
    src, dst, probe = _run(KERNEL)
    assert torch.equal(dst[:6], src)
    assert torch.equal(dst[6:], torch.zeros(2, 32))  # out-of-bounds rows arrive as zeros
    # 128-byte swizzle: row r's 16-byte chunk c lies at chunk c ^ (r % 8); the word at chunk 0 of
    # row r is element (r, 4 (r % 8)) of the box
    want = torch.tensor([src[r, 4 * r].item() if r < 6 else 0.0 for r in range(8)])
    assert torch.equal(probe, want)


def test_inline_asm_scopes_are_flattened_and_their_labels_renamed():
    prog = InlineAsmProgram(KERNEL)
    assert "LAB_WAIT_1" in prog.labels and "LAB_WAIT" not in prog.labels
    ops = [op for _, op, _ in named_barriers(prog).instrs]
    assert "bar.sync" not in ops and ops.count("ptxsim.nbar") == 2


def test_a_tma_store_never_waited_for_is_caught():
    with pytest.raises(AssertionError, match="not waited for"):
        _run(KERNEL.replace("    cp.async.bulk.wait_group.read 0;\n", ""))


def test_a_transaction_count_never_met_deadlocks():
    with pytest.raises(RuntimeError, match="deadlock"):
        _run(KERNEL.replace("[__dynamic_shmem__0], 1024;", "[__dynamic_shmem__0], 2048;"))


def test_tensor_map_cells_drop_static_unit_modes():
    # (X=4, T=3, heads=1, B=2), heads static 1: the kernel passes three coordinates
    tm = TensorMap(0, (4, 3, 1, 2), (2, 8, 8, 24), (4, 2, 1, 1), 2, 0, (True, False, True, False))
    cells = list(tm.cells([0, 2, 1]))  # rows 2 (in bounds) and 3 (out) of batch 1
    assert [off for off, _ in cells] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [ga for _, ga in cells] == [24 + 16 + 2 * i for i in range(4)] + [None] * 4
    assert len(list(tm.cells([0, 0, 0, 0]))) == 8  # all four coordinates: no mode dropped
