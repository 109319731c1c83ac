"""How close kda_cute_b1 is to what its bytes allow, and how its ratio to fla depends on the clock.

b1's contract (issue #5) fixes its bytes: it reads kg, w, u and writes h (every chunk) and v_new
in fla's layouts, 5.37 GB at B16 T8192 H=HV=16 K128 V256 bf16, 60% of it writes. Four tables, one
process, one GPU (`--parts`, default all):

1. stages: kda_cute_b1 (and --alt candidate packages) against fla's fwd_h, without and with an
   initial state, under three clocks: one call from an idle GPU (host work counted), three calls
   back to back (what check_scans / ab_stage use), primed (device time only, cuda_clock), and
   the kernels' own durations from torch.profiler.
2. streaming: the same byte counts as a contiguous 2:3 read / write mix (no layout at all).
3. pattern: b1's tiles in fla's layouts (kg / w [64, 128] and u [64, BV] read, h [128, BV] and
   v_new [64, BV] written per chunk) moved without the recurrence: `tiles`, one short program
   per (b, chunk, hv, V tile), chunk- or batch-major, with plain or TMA loads / stores; and
   `stream`, b1's own grid and walk (one long-lived program per (b, hv, V tile), chunk after
   chunk) with the same body.
4. quantization: b1 at grid shapes of equal bytes, from one wave (B4 T32768: every CTA runs from
   start to end, its batch's CTAs near one chunk index) to 7.8 waves.

Measured (H200, 2026-12-01, bench/results/scans_2026-12-01.md "Seventh session"): primed, b1
1.425 ms vs fla 1.789 (1.26x; the profiler 1.423 vs 1.774); contiguous mix 1.299; tiles
chunk-major 1.350, batch-major 1.308; stream 1.454 at best; b1 with both GEMMs deleted
(candidate bytes-only, git history 7235174) 1.427-1.442; all grid shapes 3.73-3.78 TB/s. The
scan's walk, not its math, sets b1's time.

    python bench/b1_ceiling.py [--parts stages,streaming,pattern,quantization] [--alt DIR ...]
"""

import argparse
import statistics

import torch
import triton
import triton.language as tl
from cuda_clock import median_ms

K, V, BT = 128, 256, 64


@triton.jit
def _mix23(x, y, a, b, c, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    bx = tl.load(x + i, mask=m)
    by = tl.load(y + i, mask=m)
    tl.store(a + i, bx, mask=m)
    tl.store(b + i, by, mask=m)
    tl.store(c + i, bx + by, mask=m)


@triton.jit
def _tile(kg, w, u, h, vn, ib, ihv, ci, iv, T, NT, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          BT: tl.constexpr, BV: tl.constexpr):
    """One (b, chunk, hv, V tile) of b1's bytes: read kg / w [BT, K] and u [BT, BV], write v_new
    [BT, BV] and h [K, BV] in fla's layouts (values: cheap sums, so no load is dead)."""
    rt, rk, rv = tl.arange(0, BT), tl.arange(0, K), iv * BV + tl.arange(0, BV)
    t = ci * BT + rt
    o_k = (ib.to(tl.int64) * T * HV + ihv) * K + t[:, None] * (HV * K) + rk[None, :]
    o_v = (ib.to(tl.int64) * T * HV + ihv) * V + t[:, None] * (HV * V) + rv[None, :]
    o_h = ((ib.to(tl.int64) * NT + ci) * HV + ihv) * K * V + rk[:, None] * V + rv[None, :]
    b_kg = tl.load(kg + o_k).to(tl.float32)
    b_w = tl.load(w + o_k).to(tl.float32)
    b_u = tl.load(u + o_v).to(tl.float32)
    tl.store(vn + o_v, (b_u + tl.sum(b_w, 1)[:, None]).to(vn.dtype.element_ty))
    tl.store(h + o_h, tl.broadcast_to(tl.sum(b_kg, 0)[:, None], (K, BV)).to(h.dtype.element_ty))


@triton.jit
def _tiles(kg, w, u, h, vn, T, NT, B, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
           BT: tl.constexpr, BV: tl.constexpr, CHUNK_MAJOR: tl.constexpr):
    """b1's tiles of one (b, chunk, hv, V tile) per program, no recurrence: the access pattern
    moved by many short programs, as the contiguous mix is (CHUNK_MAJOR: programs in flight share
    a chunk index across batches, as b1's CTAs do; else a batch's chunks run in order)."""
    iv, ihv, iz = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if CHUNK_MAJOR:
        ci, ib = iz // B, iz % B
    else:
        ib, ci = iz // NT, iz % NT
    _tile(kg, w, u, h, vn, ib, ihv, ci, iv, T, NT, HV, K, V, BT, BV)


@triton.jit
def _tiles_tma(kg_d, w_d, u_d, h_d, vn_d, kg, w, u, h, vn, T, NT, B, HV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
               TMA_LD: tl.constexpr, TMA_ST: tl.constexpr):
    """`_tiles` (chunk-major) with the loads (TMA_LD) and / or the stores (TMA_ST) TMA copies (host
    tensor descriptors over 2-D views: kg / w [B*T, HV*K], u / v_new [B*T, HV*V], h [B*NT*HV*K, V])."""
    iv, ihv, iz = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ci, ib = iz // B, iz % B
    row = ib * T + ci * BT
    rt, rk, rv = tl.arange(0, BT), tl.arange(0, K), iv * BV + tl.arange(0, BV)
    o_k = (row.to(tl.int64) + rt[:, None]) * (HV * K) + ihv * K + rk[None, :]
    o_v = (row.to(tl.int64) + rt[:, None]) * (HV * V) + ihv * V + rv[None, :]
    h_row = ((ib * NT + ci) * HV + ihv) * K
    o_h = (h_row.to(tl.int64) + rk[:, None]) * V + rv[None, :]
    if TMA_LD:
        b_kg = kg_d.load([row, ihv * K]).to(tl.float32)
        b_w = w_d.load([row, ihv * K]).to(tl.float32)
        b_u = u_d.load([row, ihv * V + iv * BV]).to(tl.float32)
    else:
        b_kg = tl.load(kg + o_k).to(tl.float32)
        b_w = tl.load(w + o_k).to(tl.float32)
        b_u = tl.load(u + o_v).to(tl.float32)
    b_v = (b_u + tl.sum(b_w, 1)[:, None]).to(vn.dtype.element_ty)
    b_h = tl.broadcast_to(tl.sum(b_kg, 0)[:, None], (K, BV)).to(h.dtype.element_ty)
    if TMA_ST:
        vn_d.store([row, ihv * V + iv * BV], b_v)
        h_d.store([h_row, iv * BV], b_h)
    else:
        tl.store(vn + o_v, b_v)
        tl.store(h + o_h, b_h)


@triton.jit
def _stream(kg, w, u, h, vn, T, NT, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
            BT: tl.constexpr, BV: tl.constexpr):
    """b1's grid and walk (one long-lived program per (b, hv, V tile), chunk after chunk) with
    `_tile` per chunk and no recurrence: nothing carried between chunks, so Triton pipelines the
    loads (num_stages) as it likes."""
    iv, ihv, ib = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    for ci in range(NT):
        _tile(kg, w, u, h, vn, ib, ihv, ci, iv, T, NT, HV, K, V, BT, BV)


def _gb(B, T, H, HV):
    NT = -(-T // BT)
    rd = 2 * B * T * (H + HV) * K + 2 * B * T * HV * V
    wr = 2 * B * NT * HV * K * V + 2 * B * T * HV * V
    return rd / 1e9, wr / 1e9


def profiler_ms(fn, name_part: str, calls: int = 10) -> float:
    """Mean duration of the kernels whose name holds name_part, from a torch.profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = [e.device_time for e in prof.events() if name_part in e.name and e.device_time > 0]
    return statistics.median(us) / 1e3 if us else float("nan")


def streaming_rows():
    B, T, H, HV = 16, 8192, 16, 16
    rd, wr = _gb(B, T, H, HV)
    print(f"\n## streaming kernels with b1's bytes (reads {rd:.2f} GB, writes {wr:.2f} GB)")
    print("| kernel | ms | TB/s |\n|---|---|---|")
    n = int(rd * 1e9 / 2 / 2)  # bf16 elements of each read operand
    x, y = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    wn = int(wr * 1e9 / 2 / 3)
    a, b_, c = (torch.empty(wn, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = min(n, wn)
    gb = (2 * m + 3 * m) * 2 / 1e9
    for blk, nw in ((4096, 8), (8192, 8), (16384, 16), (2048, 4)):
        ms = median_ms(lambda blk=blk, nw=nw: _mix23[(triton.cdiv(m, blk),)](x, y, a, b_, c, m, BLOCK=blk,
                                                                             num_warps=nw),
                       warmup=3, reps=20, primed=True)
        print(f"| mix 2:3 contiguous ({gb:.2f} GB), block {blk}, {nw} warps | {ms:.3f} | {gb / ms:.2f} |",
              flush=True)
    ms = median_ms(lambda: a.copy_(x[: a.numel()]), warmup=3, reps=20, primed=True)
    print(f"| torch copy 1:1 ({4 * a.numel() / 1e9:.2f} GB) | {ms:.3f} | {4 * a.numel() / 1e9 / ms:.2f} |")


def pattern_rows():
    B, T, H, HV = 16, 8192, 16, 16
    rd, wr = _gb(B, T, H, HV)
    NT = T // BT
    kg = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(B, T, HV, K, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    h = torch.empty(B, NT, HV, K, V, device="cuda", dtype=torch.bfloat16)
    vn = torch.empty_like(u)
    for bv, nw, cm in ((128, 8, 1), (128, 8, 0), (128, 4, 1), (64, 4, 1), (256, 8, 1)):
        def f(bv=bv, nw=nw, cm=cm):
            _tiles[(V // bv, HV, B * NT)](kg, w, u, h, vn, T, NT, B, HV=HV, K=K, V=V, BT=BT, BV=bv,
                                          CHUNK_MAJOR=cm, num_warps=nw)
        ms = median_ms(f, warmup=3, reps=20, primed=True)
        print(f"| tiles BV={bv} warps={nw} {'chunk' if cm else 'batch'}-major | {ms:.3f} |"
              f" {(rd + wr) / ms:.2f} |", flush=True)
    for nw, ns in ((8, 1), (8, 2), (8, 3), (8, 4), (4, 2)):
        def f(nw=nw, ns=ns):
            _stream[(V // 128, HV, B)](kg, w, u, h, vn, T, NT, HV=HV, K=K, V=V, BT=BT, BV=128,
                                       num_warps=nw, num_stages=ns)
        try:
            ms = median_ms(f, warmup=3, reps=20, primed=True)
        except Exception as e:  # noqa: BLE001
            print(f"| stream warps={nw} stages={ns} | failed: {str(e).splitlines()[0][:120]} | |", flush=True)
            continue
        print(f"| stream BV=128 (b1's grid, 512 programs) warps={nw} stages={ns} | {ms:.3f} |"
              f" {(rd + wr) / ms:.2f} |", flush=True)
    from triton.tools.tensor_descriptor import TensorDescriptor

    for bv, ld, st in ((128, 1, 1), (128, 1, 0), (128, 0, 1), (128, 0, 0)):
        descs = (
            TensorDescriptor.from_tensor(kg.view(B * T, HV * K), [BT, K]),
            TensorDescriptor.from_tensor(w.view(B * T, HV * K), [BT, K]),
            TensorDescriptor.from_tensor(u.view(B * T, HV * V), [BT, bv]),
            TensorDescriptor.from_tensor(h.view(B * NT * HV * K, V), [K, bv]),
            TensorDescriptor.from_tensor(vn.view(B * T, HV * V), [BT, bv]),
        )
        def f(bv=bv, descs=descs, ld=ld, st=st):
            _tiles_tma[(V // bv, HV, B * NT)](*descs, kg, w, u, h, vn, T, NT, B, HV=HV, K=K, V=V, BT=BT,
                                              BV=bv, TMA_LD=ld, TMA_ST=st, num_warps=8)
        try:
            ms = median_ms(f, warmup=3, reps=20, primed=True)
        except Exception as e:  # noqa: BLE001
            print(f"| tiles TMA BV={bv} | failed: {str(e).splitlines()[0][:120]} | |", flush=True)
            continue
        print(f"| tiles BV={bv} chunk-major, loads {'TMA' if ld else 'LDG'}, stores {'TMA' if st else 'STG'}"
              f" | {ms:.3f} | {(rd + wr) / ms:.2f} |", flush=True)


def stage_rows(alts):
    import check_scans as cs
    from ab_stage import load_alt, stage_fns

    pkgs = {"main": "kda_cute"}
    for i, p in enumerate(alts):
        pkgs[f"alt{i}"] = load_alt(p, i)
        print(f"alt{i} = {p}")
    print("\n## b1 vs fla fwd_h, B16 T8192 H=HV=16 K128 V256 bf16 (ms; 5 rounds, median)")
    print("| h0 | contender | idle 1 call | 3 back to back | primed | profiler kernel | ratios, rate |")
    print("|---|---|---|---|---|---|---|")
    rd, wr = _gb(16, 8192, 16, 16)
    for h0 in (False, True):
        d = cs.make_inputs(16, 8192, 16, 16, V, h0=h0)
        fns = {}
        for tag, pkg in pkgs.items():
            fns.update(stage_fns("b1", pkg, d, tag))
        fns["fla"] = lambda d=d: cs.fla_b1(d)
        t = {k: {"idle": [], "inner3": [], "primed": []} for k in fns}
        for _ in range(5):
            for k, f in fns.items():
                t[k]["idle"].append(median_ms(f, warmup=2, reps=10))
                t[k]["inner3"].append(median_ms(f, warmup=1, reps=10, inner=3))
                t[k]["primed"].append(median_ms(f, warmup=1, reps=10, primed=True))
        prof = {k: profiler_ms(f, "chunk_gated_delta_rule_fwd_kernel" if k == "fla" else "kda_cute_b1")
                for k, f in fns.items()}
        med = {k: {m: statistics.median(v) for m, v in tk.items()} for k, tk in t.items()}
        for k in fns:
            r = med[k]
            ratio = " ".join(f"{med['fla'][m] / r[m]:.2f}x" for m in ("idle", "inner3", "primed"))
            print(f"| {h0} | {k} | {r['idle']:.3f} | {r['inner3']:.3f} | {r['primed']:.3f} | {prof[k]:.3f}"
                  f" | fla/this {ratio} (profiler {prof['fla'] / prof[k]:.2f}x);"
                  f" {(rd + wr) / r['primed']:.2f} TB/s primed |",
                  flush=True)
        del d, fns
        torch.cuda.empty_cache()


def _random_inputs(B, T, H):
    """kg, w, u, gk for a timing-only b1 call (values do not change its time; fla's intra, which
    check_scans uses for realistic inputs, would autotune at each new H)."""
    kg, w = (0.1 * torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    u = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    gk = -0.1 * torch.rand(B, T, H, K, device="cuda").view(B, T // BT, BT, H, K).cumsum(2).view(B, T, H, K)
    return kg, w, u, gk


def quantization_rows():
    import kda_cute.b1 as b1

    print("\n## grid shape at equal bytes: time per GB, kda_cute_b1 2 x 2 (primed, no h0)")
    print("| shape | CTAs | waves of 132 | ms | GB | TB/s |\n|---|---|---|---|---|---|")
    for B, T, H in ((16, 8192, 16), (33, 8192, 8), (4, 32768, 16), (8, 16384, 16), (32, 4096, 16)):
        d = _random_inputs(B, T, H)
        ms = statistics.median(median_ms(lambda d=d: b1.fwd_h(*d, stages=2, warpgroups=2), warmup=2,
                                         reps=10, primed=True) for _ in range(3))
        rd, wr = _gb(B, T, H, H)
        ctas = B * H * V // 128
        print(f"| B{B} T{T} H=HV={H} | {ctas} | {ctas / 132:.2f} | {ms:.3f} | {rd + wr:.2f} |"
              f" {(rd + wr) / ms:.2f} |", flush=True)
        del d
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--alt", action="append", default=[], help="a candidate kda_cute package directory")
    ap.add_argument("--parts", default="stages,streaming,pattern,quantization",
                    help="comma-separated subset of the four tables")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    import check_scans as cs

    if "stages" in parts:
        cs.tune_fla_at_ref()  # fla's autotune at the reference shape first (bench/NOTES.md)
        stage_rows(a.alt)
    for name, fn in (("streaming", streaming_rows), ("pattern", pattern_rows),
                     ("quantization", quantization_rows)):
        if name in parts:
            fn()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
