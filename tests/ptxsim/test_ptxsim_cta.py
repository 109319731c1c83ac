"""The base interpreter on hand-written PTX: the parser, a loop, warp shuffles, a CTA barrier,
float math and conversions through global memory, a divergent collective, the mma.sync layout."""

import numpy as np
import pytest
import torch
from ptxsim import CTA, Program, global_memory, readback
from ptxsim.numerics import b2f, f2b

HEADER = """
.version 8.0
.target sm_90a
.address_size 64

"""

TOY = HEADER + """
.visible .entry toy(
    .param .align 8 .b8 toy_param_0[8],
    .param .align 8 .b8 toy_param_1[8],
    .param .align 8 .b8 toy_param_2[8],
    .param .align 8 .b8 toy_param_3[8]
)
{
    .reg .pred %p<4>;
    .reg .b16 %rs<4>;
    .reg .b32 %r<16>;
    .reg .f32 %f<8>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [toy_param_0];     // x: f32[64]
    ld.param.u64 %rd2, [toy_param_1];     // sum of i < tid: u32[64]
    ld.param.u64 %rd3, [toy_param_2];     // sum of tid over the warp: u32[64]
    ld.param.u64 %rd4, [toy_param_3];     // bf16(exp2(2 x + 1)): u16[64]
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd5, %r1, 4;
    mov.u32 %r2, 0;
    mov.u32 %r3, 0;
$L_loop:
    setp.ge.u32 %p1, %r3, %r1;
    @%p1 bra $L_done;
    add.s32 %r2, %r2, %r3;
    add.s32 %r3, %r3, 1;
    bra.uni $L_loop;
$L_done:
    add.s64 %rd6, %rd2, %rd5;
    st.global.u32 [%rd6], %r2;
    mov.u32 %r4, %r1;
    shfl.sync.bfly.b32 %r5, %r4, 16, 31, -1;
    add.s32 %r4, %r4, %r5;
    shfl.sync.bfly.b32 %r5, %r4, 8, 31, -1;
    add.s32 %r4, %r4, %r5;
    shfl.sync.bfly.b32 %r5, %r4, 4, 31, -1;
    add.s32 %r4, %r4, %r5;
    shfl.sync.bfly.b32 %r5, %r4, 2, 31, -1;
    add.s32 %r4, %r4, %r5;
    shfl.sync.bfly.b32 %r5, %r4, 1, 31, -1;
    add.s32 %r4, %r4, %r5;
    add.s64 %rd7, %rd3, %rd5;
    bar.sync 0;
    st.global.u32 [%rd7], %r4;
    add.s64 %rd8, %rd1, %rd5;
    ld.global.f32 %f1, [%rd8];
    fma.rn.f32 %f2, %f1, 0f40000000, 0f3F800000;   // 2 x + 1
    ex2.approx.ftz.f32 %f3, %f2;
    cvt.rn.bf16.f32 %rs1, %f3;
    mul.wide.u32 %rd9, %r1, 2;
    add.s64 %rd10, %rd4, %rd9;
    st.global.u16 [%rd10], %rs1;
    ret;
}
"""


def _launch(text, tensors, ntid):
    prog = Program(text)
    gmem, bases = global_memory(tensors)
    params = {(name, 0): base for (name, _), base in zip(prog.params, bases, strict=True)}
    CTA(prog, gmem, params, (0, 0, 0), ntid=ntid).run()
    return [readback(gmem, t, b) for t, b in zip(tensors, bases, strict=True)]


def test_parser():
    prog = Program(TOY)
    assert prog.params == [(f"toy_param_{i}", "8") for i in range(4)]
    assert prog.instrs[prog.labels["$L_loop"]] == (None, "setp.ge.u32", ["%p1", "%r3", "%r1"])
    assert prog.instrs[prog.labels["$L_loop"] + 1] == ((False, "%p1"), "bra", ["$L_done"])
    assert (None, "shfl.sync.bfly.b32", ["%r5", "%r4", "16", "31", "-1"]) in prog.instrs
    assert Program.parse("@!%p2 st.global.v2.f32 [%rd1+8], {%f1, %f2}") == (
        (True, "%p2"), "st.global.v2.f32", ["[%rd1+8]", "{%f1, %f2}"])
    assert not any(op.startswith(".reg") for _, op, _ in prog.instrs)


def test_toy_kernel_loop_shuffle_barrier_and_float_math():
    x = torch.arange(-32, 32, dtype=torch.float32) / 7
    outs = [torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32),
            torch.zeros(64, dtype=torch.int16)]
    _, loop, warp, e = _launch(TOY, [x, *outs], ntid=64)
    tid = torch.arange(64)
    assert torch.equal(loop, (tid * (tid - 1) // 2).int())
    assert torch.equal(warp, torch.tensor([496] * 32 + [1520] * 32, dtype=torch.int32))
    fma = (2 * x.double() + 1).float()  # exact in float64, rounded once (fma.rn)
    want = torch.exp2(fma.double()).float().to(torch.bfloat16)  # ex2 exact, then round to nearest even
    assert torch.equal(e.view(torch.bfloat16), want)


def test_a_shuffle_with_lanes_gone_is_an_error():
    # lanes 16..31 exit before the shuffle: the warp reaches the collective with 16 live lanes
    text = TOY.replace("    mov.u32 %r4, %r1;\n",
                       "    setp.ge.u32 %p2, %r1, 16;\n    @%p2 ret;\n    mov.u32 %r4, %r1;\n")
    x = torch.zeros(64)
    outs = [torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32),
            torch.zeros(64, dtype=torch.int16)]
    with pytest.raises(RuntimeError, match="diverged"):
        _launch(text, [x, *outs], ntid=64)


def test_an_unknown_opcode_is_an_error():
    text = TOY.replace("    ret;\n", "    brev.b32 %r6, %r1;\n    ret;\n")
    outs = [torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32),
            torch.zeros(64, dtype=torch.int16)]
    with pytest.raises(NotImplementedError, match="brev"):
        _launch(text, [torch.zeros(64), *outs], ntid=64)


def test_mma_m16n8k8_tf32_fragments_follow_the_isa_layout():
    """mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 with the PTX ISA's fragment layout
    (groupID = lane / 4, tig = lane % 4): a0..a3 = A[g, t], A[g+8, t], A[g, t+4], A[g+8, t+4];
    b0, b1 = B[t, g], B[t+4, g]; c0..c3 = C[g, 2t], C[g, 2t+1], C[g+8, 2t], C[g+8, 2t+1]."""
    rng = np.random.default_rng(0)
    A = rng.standard_normal((16, 8)).astype(np.float32)
    Bm = rng.standard_normal((8, 8)).astype(np.float32)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    def c_slots(g, t):  # the accumulator (C, D) elements of lane (g, t)
        return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]

    frags = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        frags.append(([f2b(A[g, t]), f2b(A[g + 8, t]), f2b(A[g, t + 4]), f2b(A[g + 8, t + 4])],
                      [f2b(Bm[t, g]), f2b(Bm[t + 4, g])],
                      [f2b(C[ij]) for ij in c_slots(g, t)]))
    out = CTA.mma(frags)

    def tf32(m):  # the operands' low 13 mantissa bits are ignored (truncated)
        return (m.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)

    D = (tf32(A) @ tf32(Bm) + C).astype(np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        assert [b2f(v) for v in out[lane]] == [D[ij] for ij in c_slots(g, t)]
    assert not np.allclose(D, (A.astype(np.float64) @ Bm + C).astype(np.float32), rtol=0, atol=0)
