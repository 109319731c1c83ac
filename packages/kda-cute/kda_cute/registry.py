"""The CuTe stages: one record per kernel module, from which everything else is derived.

A record says what a stage is to the rest of the project, without importing the CuTe DSL:

    name        the chain's stage name; the kernel module is `kda_cute.<module or name>`
    contract    the contract function (same name and arguments in `kda_cute.reference` and in the
                module; ARCHITECTURE.md lists them)
    kernels     the kernel names a CUDA trace shows (as substrings of the DSL-decorated names)
    probe       `probe(dims) -> args`: the positional arguments a chain call passes at these
                extents, as meta tensors (for `kda_chain.is_supported`: no memory)
    flags       keyword flags the chain passes to the CuTe kernel only (fla's function lacks them)
    module      the kernel module's name when it is not the stage's (default: the stage's)
    replaces    the stages this one can compute in its one kernel: once it ran its CuTe kernel, the
                chain may not call them (bwd_chunk's: bwd_wy_dqkg and intra are its "split" fallback,
                l2norm_bwd is folded in where HV == H, gate_bwd with the gate in the op; fwd_prep's:
                l2norm_fwd), so they are not expected; one that is called must still run its CuTe
                kernel

Derived from `STAGES`: the chain's stage table (`kda_chain.stages`: CuTe kernel, then fla, then
the reference), `kda_chain.is_supported`, the witness's expected kernels (registered by the
chain at import) and its CLI text, the tests' and the benchmarks' stage lists.

Adding a CuTe stage: write `kda_cute/<name>.py` (exporting the contract function, `launch`,
`is_supported`) and append one record here. `tests/kda_chain/test_registry.py` fails if the
chain dispatches to a CuTe kernel the witness does not expect.

A kernel module exports
    <contract>(...)       the contract, with checks (ValueError on a call it cannot compute)
    launch(...)           the contract without the checks (the chain's gate has just made them)
    is_supported(...)     None, or the reason the kernel does not take this call
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from ._common.support import device_of, device_reason, log_once, probing

__all__ = ["STAGES", "BY_NAME", "CuteStage", "Dims", "chain_kernels", "kernel_stages", "replaced",
           "device_of", "device_reason", "log_once", "probing"]


@dataclass(frozen=True)
class Dims:
    """The extents of a chunk_kda call: q, k [B, T, H, K]; v [B, T, HV, V]; `dtype` q's."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: torch.dtype = torch.bfloat16

    def t(self, *shape, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A meta tensor (no storage) of this shape, in q's dtype unless given."""
        return torch.empty(shape, device="meta", dtype=dtype or self.dtype)


@dataclass(frozen=True)
class CuteStage:
    name: str
    contract: str
    kernels: tuple[str, ...]
    probe: Callable[[Dims], tuple]
    flags: tuple[str, ...] = ()
    module: str = ""
    replaces: tuple[str, ...] = ()

    @property
    def module_name(self) -> str:
        return f"kda_cute.{self.module or self.name}"

    def load(self) -> ModuleType | None:
        """The kernel module, or None if it is not written yet (any other import error raises)."""
        try:
            return importlib.import_module(self.module_name)
        except ModuleNotFoundError as e:
            if e.name == self.module_name:
                return None
            raise


_F32 = torch.float32


def _probe_fwd(d: Dims) -> tuple:
    # fwd_scan(q, qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale); qg as
    # fwd_intra gives it when the kernel is planned, Aqk in k's dtype (fla 0.6.0)
    kv, gk = d.t(d.B, d.T, d.HV, d.K), d.t(d.B, d.T, d.HV, d.K, dtype=_F32)
    return (d.t(d.B, d.T, d.H, d.K), kv, kv, kv, d.t(d.B, d.T, d.HV, d.V), gk, d.t(d.B, d.T, d.HV, 64),
            None, False, d.K**-0.5)


def _probe_b1(d: Dims) -> tuple:
    # fwd_h(kg, w, u, gk, initial_state, output_final_state)
    kv = d.t(d.B, d.T, d.HV, d.K)
    return (kv, kv, d.t(d.B, d.T, d.HV, d.V), d.t(d.B, d.T, d.HV, d.K, dtype=_F32), None, False)


def _probe_dhu(d: Dims) -> tuple:
    # bwd_dhu(qg, kg, w, gk, h0, dht, do, dv, scale, Aqk): the fused form the chain passes
    # (dv = tril(Aqk)^T do inside, no dv)
    kv, vv = d.t(d.B, d.T, d.HV, d.K), d.t(d.B, d.T, d.HV, d.V)
    return (kv, kv, kv, d.t(d.B, d.T, d.HV, d.K, dtype=_F32), None, None, vv, None, d.K**-0.5,
            d.t(d.B, d.T, d.HV, 64))


def _probe_intra(d: Dims) -> tuple:
    # bwd_intra(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg): dq, dk, db, dg fp32 from wy_dqkg
    qk, g = d.t(d.B, d.T, d.H, d.K), d.t(d.B, d.T, d.HV, d.K, dtype=_F32)
    a = d.t(d.B, d.T, d.HV, 64, dtype=_F32)
    return (qk, qk, g, d.t(d.B, d.T, d.HV), a, a, g, g, d.t(d.B, d.T, d.HV, dtype=_F32), g)


def _probe_wy_dqkg(d: Dims) -> tuple:
    # bwd_wy_dqkg(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale)
    qk, vv = d.t(d.B, d.T, d.H, d.K), d.t(d.B, d.T, d.HV, d.V)
    st = d.t(d.B, -(-d.T // 64), d.HV, d.K, d.V)
    gk, a = d.t(d.B, d.T, d.HV, d.K, dtype=_F32), d.t(d.B, d.T, d.HV, 64)
    return (qk, qk, vv, vv, gk, d.t(d.B, d.T, d.HV), a, st, vv, st, vv, d.K**-0.5)


def _probe_fwd_prep(d: Dims) -> tuple:
    # fwd_prep(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, chunk_size,
    # want_qg): the gate in the op, as the reference shape runs it
    qk = d.t(d.B, d.T, d.H, d.K)
    return (qk, qk, d.t(d.B, d.T, d.HV, d.V), d.t(d.B, d.T, d.HV, d.K), d.t(d.B, d.T, d.HV),
            d.t(d.HV, dtype=_F32), None, None, True, d.K**-0.5, 64, True)


def _probe_bwd_prep(d: Dims) -> tuple:
    # bwd_prep(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size):
    # the gate in the op, as the reference shape runs it
    qk = d.t(d.B, d.T, d.H, d.K)
    return (qk, qk, d.t(d.B, d.T, d.HV, d.V), d.t(d.B, d.T, d.HV, d.K), d.t(d.B, d.T, d.HV),
            d.t(d.HV, dtype=_F32), None, d.t(d.B, d.T, d.HV, 64), None, True, 64)


def _probe_l2norm_fwd(d: Dims) -> tuple:
    # l2norm_fwd(x): q (and k) with use_qk_l2norm_in_kernel
    return (d.t(d.B, d.T, d.H, d.K),)


def _probe_l2norm_bwd(d: Dims) -> tuple:
    # l2norm_bwd(y, rstd, dy): dy as intra emits it when HV == H (q's dtype)
    qk = d.t(d.B, d.T, d.H, d.K)
    return (qk, d.t(d.B, d.T, d.H, dtype=_F32), qk)


STAGES: tuple[CuteStage, ...] = (
    CuteStage("l2norm_fwd", "l2norm_fwd", ("kda_cute_l2norm_fwd",), _probe_l2norm_fwd),
    # with the L2 norm in the op the chain hands it raw q, k (l2norm=True): l2norm_fwd inside
    CuteStage("fwd_prep", "fwd_prep", ("kda_cute_prep",), _probe_fwd_prep, module="prep",
              replaces=("l2norm_fwd",)),
    CuteStage("fwd", "fwd_scan", ("kda_cute_fwd",), _probe_fwd),
    CuteStage("bwd_prep", "bwd_prep", ("kda_cute_bwd_prep",), _probe_bwd_prep),
    CuteStage("b1", "fwd_h", ("kda_cute_b1",), _probe_b1),
    CuteStage("dhu", "bwd_dhu", ("kda_cute_dhu",), _probe_dhu),
    CuteStage("bwd_wy_dqkg", "bwd_wy_dqkg", ("kda_cute_wy_dqkg",), _probe_wy_dqkg, flags=("want_dAqk",),
              module="wy_dqkg"),
    CuteStage("intra", "bwd_intra", ("kda_cute_intra",), _probe_intra, flags=("fold_dg", "emit_bf16")),
    # bwd_wy_dqkg + bwd_dAv's dA + intra (fold_dg) in one kernel (with the rstds l2norm_bwd, with
    # A_log gate_bwd too); where it does not run, the chain runs the two stages above
    CuteStage("bwd_chunk", "bwd_chunk", ("kda_cute_bwd_chunk",), _probe_wy_dqkg, flags=("emit_bf16",),
              replaces=("bwd_wy_dqkg", "intra", "l2norm_bwd", "gate_bwd")),
    CuteStage("l2norm_bwd", "l2norm_bwd", ("kda_cute_l2norm_bwd",), _probe_l2norm_bwd),
)
BY_NAME: dict[str, CuteStage] = {s.name: s for s in STAGES}


def kernel_stages() -> dict[str, str]:
    """Every CuTe kernel name -> the stage it implements."""
    return {k: s.name for s in STAGES for k in s.kernels}


def replaced(ran: set[str] | None = None) -> set[str]:
    """The stages a chain call need not make because a stage in `ran` (default: every stage, as
    when all take their CuTe kernels) can compute them in its one kernel."""
    return {n for s in STAGES if ran is None or s.name in ran for n in s.replaces}


def chain_kernels() -> dict[str, str]:
    """The CuTe kernels a chain call launches when every stage takes its kernel (the default flags,
    HV == H) -> their stages."""
    gone = replaced()
    return {k: st for k, st in kernel_stages().items() if st not in gone}
