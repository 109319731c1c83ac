"""Host policy the three state scans share (b1 = fwd_h, fwd = fwd_h + fwd_o, dhu): DSL-free.

What a scan kernel is built for (K = 128, V in 64-wide tiles, bf16 / fp16, contiguous fp32
states), how its compiled variant is chosen (TMA ring depth, warpgroups per CTA, by grid), the
frozen config every build is keyed on, and the placeholder tensor an absent state binds to.
Importing this module does not import the CuTe DSL: a stage's `is_supported` answers without it.
The device half (views, TMA, wgmma, the mbarrier ring) is `kda_cute._scan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ._common.cache import constant, interned
from ._common.lazy import cutlass_dtype
from ._common.support import compile_arch, sm_count_of

BT = 64  # chunk
KD = 128  # key dim (state rows)
BV = 64  # V tile per warpgroup (state columns)
THREADS = 128  # one warpgroup

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # operand dtypes -> config names
# the H200's and H100 SXM's SM count: the variant rule's default where no device is asked (CPU)
DEFAULT_SMS = 132
# V tiles (B * HV * V / 64) from which a CTA takes two warpgroups (two V tiles sharing every
# V-independent operand tile), in all three scans: measured per kernel in docs/perf/{b1,fwd,dhu}.md.
WIDE_FROM_TILES = 256


# ----------------------------------------------------------------------------------- variants
def v_tiles(B: int, HV: int, V: int) -> int:
    return B * HV * (V // BV)


def wide_grid(B: int, HV: int, V: int) -> bool:
    """Two warpgroups (two V tiles) per CTA: V pairs up and the grid has >= WIDE_FROM_TILES tiles."""
    return V % (2 * BV) == 0 and v_tiles(B, HV, V) >= WIDE_FROM_TILES


def sms_of(t: torch.Tensor) -> int:
    """The SM count of `t`'s GPU (DEFAULT_SMS for a CPU or meta tensor: compile-only builds)."""
    return sm_count_of(t) if t.is_cuda else DEFAULT_SMS


def pick_warpgroups(V: int, requested) -> int:
    """Warpgroups per CTA (each owns one 64-wide V tile); 2 needs V % 128 == 0, else 1."""
    n = 1 if requested is None else int(requested)
    if n not in (1, 2):
        raise ValueError(f"warpgroups must be 1 or 2 (got {requested})")
    return n if V % (BV * n) == 0 else 1


def pick_build(auto: tuple[int, int], stages, warpgroups, V: int) -> tuple[int, int]:
    """(stages, warpgroups) to compile: the stage's `variant()` choice `auto`, each overridden
    by a caller's explicit value, warpgroups through `pick_warpgroups`."""
    return (auto[0] if stages is None else stages,
            pick_warpgroups(V, auto[1] if warpgroups is None else warpgroups))


# ------------------------------------------------------------------------------------ reasons
def extent_reason(K: int, V: int, T: int) -> str | None:
    """The extents every scan is built for: K = 128, V in 64-wide tiles, T >= 1."""
    if K != KD:
        return f"K={K} (only K=128)"
    if V % BV:
        return f"V={V} (V % 64 != 0)"
    if T < 1:
        return "T=0"
    return None


def floor_reason(shape_bthv, floor: int) -> str | None:
    """The measured grid floor of a scan: `shape_bthv` is a [B, T, HV, V] output's shape."""
    B, _, HV, V = shape_bthv
    tiles = v_tiles(B, HV, V)
    if tiles < floor:
        return f"{tiles} V tiles (B*HV*V/64) below the measured floor {floor} (fla is faster)"
    return None


def chunks_reason(chunks, u) -> str | None:
    """A packed call's chunk table (`chunks`: int32 [2, N + 1] on u's device, as kda_chain.varlen
    builds it: row 0 the chunk offsets, each sequence padded to whole chunks; row 1 the walk
    order, a permutation of 0 .. N - 1 then a 0: CTA row z walks sequence chunks[1, z], so the
    longest can start first) against u [1, T, HV, V]. The contents are not read here (that would
    sync): the table's builder checks them."""
    if chunks is None:
        return None
    if chunks.dtype != torch.int32 or chunks.dim() != 2 or chunks.shape[0] != 2 or chunks.shape[1] < 2:
        return "chunks must be an int32 [2, N + 1] table (the chunk offsets, then the walk order)"
    if chunks.device != u.device or not chunks.is_contiguous():
        return "chunks must be contiguous, on the operands' device"
    if u.shape[0] != 1 or u.shape[1] % BT:
        return "with chunks the operands are packed [1, T, ...], T a whole number of chunks"
    return None


def seqs(u, chunks) -> int:
    """The number of state rows: B, or N sequences with a chunk table."""
    return u.shape[0] if chunks is None else chunks.shape[1] - 1


def state_reason(name: str, t, B: int, HV: int, K: int, V: int) -> str | None:
    """An optional fp32 [B, HV, K, V] state (h0, ht's gradient): None when absent or usable."""
    if t is None:
        return None
    if t.dtype != torch.float32 or tuple(t.shape) != (B, HV, K, V):
        return f"{name} must be fp32 [B, HV, K, V]"
    if not t.is_contiguous() or t.data_ptr() % 16:
        return f"{name} not contiguous / aligned"
    return None


def operand_reason(kg, w, u, gk, initial_state=None, chunks=None) -> str | None:
    """The checks of fwd_h's operands (kg, w, u, gk, h0, the chunk table), which b1 and fwd share."""
    if u.dtype not in DTYPES:
        return f"dtype {u.dtype} (bf16/fp16 only)"
    if kg.dtype != u.dtype or w.dtype != u.dtype:
        return "kg, w, u must share one dtype"
    if gk.dtype != torch.float32:
        return f"gk must be fp32 (got {gk.dtype})"
    if u.dim() != 4 or kg.dim() != 4 or w.dim() != 4 or gk.dim() != 4:
        return "expected [B, T, heads, dim] tensors (varlen / cu_seqlens not supported)"
    B, T, HV, V = u.shape
    K = kg.shape[-1]
    r = extent_reason(K, V, T)
    if r:
        return r
    if tuple(w.shape) != (B, T, HV, K) or tuple(gk.shape) != (B, T, HV, K):
        return "w / gk must be [B, T, HV, K]"
    if kg.shape[0] != B or kg.shape[1] != T or HV % kg.shape[2]:
        return "kg must be [B, T, H, K] with HV % H == 0"
    for name, t in (("kg", kg), ("w", w), ("u", u), ("gk", gk)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    return chunks_reason(chunks, u) or state_reason("initial_state", initial_state, seqs(u, chunks), HV, K, V)


# ------------------------------------------------------------------------------------- builds
@dataclass(frozen=True, kw_only=True)
class ScanConfig:
    """What every scan build depends on; each scan's config adds its own fields. A config is the
    call cache's compile key: a field missing from it would reuse a stale compiled kernel."""

    dtype: str  # "bf16" / "fp16"
    V: int
    HV: int
    ratio_k: int  # HV // kg's heads
    stages: int
    nwg: int
    varlen: bool = False  # a chunk table gives each CTA's sequence (grid z = N, not B)
    arch: str = dataclasses.field(default_factory=compile_arch)

    @classmethod
    def of(cls, t: torch.Tensor, kg: torch.Tensor, stages: int, nwg: int, chunks=None, **fields):
        """The config for operands like `t` ([B, T, HV, V] in the operand dtype), kg's heads and
        the chunk table (or None)."""
        HV = t.shape[2]
        return _new_config(cls, dtype=DTYPES[t.dtype], V=t.shape[3], HV=HV, ratio_k=HV // kg.shape[2],
                           stages=stages, nwg=nwg, varlen=chunks is not None, arch=compile_arch(), **fields)


_new_config = interned(lambda cls, **fields: cls(**fields))  # (a build per config class and signature)


class Build:
    """A scan kernel's builder over its frozen config (the compile key): the config's fields as
    attributes, `dtype` as the cutlass type; tracing adds the layouts and the smem struct."""

    def __init__(self, config):
        for f in dataclasses.fields(config):
            setattr(self, f.name, getattr(config, f.name))
        self.dtype = cutlass_dtype(config.dtype)


_dummies: dict = {}


def dummy(dev) -> torch.Tensor:
    """A tiny fp32 [1, 1, 128, 64] placeholder for an absent h0 / ht / dht / dh0 (never touched)."""
    d = _dummies.get(dev)
    if d is None:
        d = _dummies[dev] = constant(torch.zeros((1, 1, KD, BV), dtype=torch.float32, device=dev))
    return d


def chunk_args(chunks, dev) -> tuple:
    """(the chunk-table argument, its dynamic dims): the table flat (int32 [2 (N + 1)]: the
    offsets at 0 .. N, the walk order from N + 1; `_scan.Cta`), or an int32 [2] placeholder a
    fixed-length build never reads."""
    if chunks is not None:
        return chunks.view(-1), (0,)
    d = _dummies.get((dev, "chunks"))
    if d is None:
        d = _dummies[(dev, "chunks")] = constant(torch.zeros(2, dtype=torch.int32, device=dev))
    return d, ()


def packed_row_reason(table, T_raw, u, chunks) -> str | None:
    """A scan's packed-row form (an output written, or an input read, straight on the packed row
    [1, T_raw, ...] through the chunk table, kda_chain.varlen's int32 [T_pad / 64, 2]: per chunk
    of the padded row u [1, T_pad, ...] its first packed token and its valid rows), or why not.
    The table's contents are trusted (reading them would sync): its builder checks them."""
    if table is None:
        return None if T_raw is None else "T_raw without a table"
    if chunks is None:
        return "a table needs chunks (the packed call's chunk offsets)"
    if u.shape[0] != 1:
        return f"a table needs the packed row [1, T, ...]; got B={u.shape[0]}"
    from ._warp import table_reason

    T_pad = u.shape[1]
    r = table_reason(table, u.device, T_pad // BT)
    if r:
        return r
    if not isinstance(T_raw, int) or isinstance(T_raw, bool) or not 1 <= T_raw <= T_pad:
        return f"T_raw must be an int in 1..{T_pad} (the packed row's tokens); got {T_raw!r}"
    return None
