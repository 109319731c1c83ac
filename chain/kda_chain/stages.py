"""The stage table: for every stage of chunk_kda, its implementations in order and their gates.

A stage call walks its implementations in order and takes the first whose gate says yes:

    cute       our CuTe kernel (the four scan/intra stages), when its module is built and
               `is_supported(...)` accepts the call
    fla        fla 0.6.0's function (Triton, CUDA only)
    reference  kda_cute.reference in plain torch: the oracle and the last resort (CPU, float64)

Every call opens one profiler range `kda::<stage>::<impl>[::<reason>]` (kda_witness's format)
whose reason says why the implementations before the chosen one were passed over, e.g.
`kda::intra::fla::cute: T % 64 != 0`. The witness reads the reasons back from the trace; the
same record goes to `dispatch_log()` for code that runs without a profiler (the CLI on CPU,
tests). `KDA_FORCE_FLA=all` or `KDA_FORCE_FLA=intra,dhu` skips the CuTe kernel of those stages;
it is read on every call.

Every function here has the contract of ARCHITECTURE.md; the fla adapters only rename
arguments. Nothing in this module computes.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import kda_witness
import torch
from kda_cute import reference as ref
from kda_cute import registry
from kda_cute._common import cache as call_cache
from kda_cute.registry import CuteStage, device_of, device_reason, log_once
from kda_witness import stage_range
from torch._C._autograd import _profiler_enabled

log = logging.getLogger("kda_chain")


FORCE_ENV = "KDA_FORCE_FLA"


def forced_fla(stage: str) -> bool:
    """`KDA_FORCE_FLA=all` or a comma list of stage names skips their CuTe kernels; read per call."""
    val = os.environ.get(FORCE_ENV, "").strip()
    if not val:
        return False
    names = {s.strip() for s in val.split(",")}
    return "all" in names or "1" in names or stage in names

# ---------------------------------------------------------------------------------------------
# dispatch record


@dataclass(frozen=True)
class Choice:
    stage: str
    impl: str
    reason: str | None


# Process-wide, not per thread: on CUDA, autograd runs the backward on its own device thread, so
# a thread-local record saw only the forward stages (on the H200 the stage benchmarks skipped
# every backward stage, 2026-11-30). Appends are atomic under the GIL; the lock guards swaps.
# Bounded: a training run makes a dozen choices per step, forever; the newest LOG_SIZE are kept.
LOG_SIZE = 4096
_lock = threading.Lock()
_log: deque[Choice] = deque(maxlen=LOG_SIZE)
_capture: list[tuple[str, tuple, dict]] | None = None


def clear_gate_cache() -> None:
    """Forget every stage's cached gate decisions and every recorded plan (after changing what a
    gate reads, e.g. a kernel module's measured floor in a test)."""
    for st in STAGES.values():
        st.decided.clear()
    with _lock:
        _plans.clear()


def dispatch_log() -> deque[Choice]:
    """The choices made (on any thread: the backward included) since `reset_dispatch_log()`, the
    newest LOG_SIZE of them."""
    return _log


def reset_dispatch_log() -> None:
    with _lock:
        _log.clear()


class capture:
    """Record every stage call's arguments made inside the block, on any thread (for benchmarks:
    each stage is then timed on the real inputs of a real chain call). Holds references: use
    briefly."""

    def __enter__(self) -> list[tuple[str, tuple, dict]]:
        global _capture
        self.calls: list[tuple[str, tuple, dict]] = []
        with _lock:
            _capture = self.calls
        return self.calls

    def __exit__(self, *exc) -> None:
        global _capture
        with _lock:
            _capture = None


# ---------------------------------------------------------------------------------------------
# gates


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


@cache
def _fla_import_error() -> str | None:
    try:
        import fla.ops.kda.chunk_bwd  # noqa: F401
    except Exception as e:  # environment-dependent
        return f"fla not importable ({type(e).__name__})"
    return None


def fla_gate(*args, **kwargs) -> str | None:
    ts = _tensors(args, kwargs)
    if not ts or device_of(ts[0]).type != "cuda":
        return "no CUDA device" if not torch.cuda.is_available() else "tensors are not on CUDA"
    if any(t.dtype == torch.float64 for t in ts):
        return "fla has no float64 kernels"
    return _fla_import_error()


def _always(*args, **kwargs) -> None:
    return None


@dataclass(frozen=True)
class Impl:
    name: str
    gate: Callable[..., str | None]
    fn: Callable


def cute_impl(rec: CuteStage) -> Impl:
    """The CuTe implementation of the stage `rec` (kda_cute.registry), its module loaded at call time.

    A module not present yet (the kernel is not written) gates with "kernel not built yet". The
    gate asks the module's `is_supported`; once it says None the call goes to the module's
    `launch` (its contract function without the checks the gate just made).
    """

    def gate(*args, **kwargs) -> str | None:
        if forced_fla(rec.name):
            return f"forced to fla by {FORCE_ENV}"
        mod = rec.load()
        if mod is None:
            return "kernel not built yet"
        r = device_reason(_tensors(args, kwargs)[0])
        if r is not None:
            return r
        return mod.is_supported(*args, **kwargs)

    mod = None  # the module, imported once (an import_module per call cost ~7 us on the H200 host)

    def fn(*args, **kwargs):
        nonlocal mod
        if mod is None:
            mod = rec.load()
        plan = getattr(_tls, "plan", None)
        if plan is None or (plan.replay is None and plan.record is None):  # no plan, or it diverged
            return mod.launch(*args, **kwargs)
        return plan.launch(rec.name, mod, args, kwargs)

    return Impl("cute", gate, fn)


def cute_planned(stage: str, *args, **kwargs) -> bool:
    """Could the CuTe kernel of `stage` take a chain call with these inputs? Asked before the
    stage's own inputs exist, to decide whether an earlier stage computes something only that
    kernel reads (fwd: qg from fwd_prep). False when forced to fla (KDA_FORCE_FLA), when the
    module is absent, or when its `plan_reason(*args, **kwargs)` gives a reason."""
    rec = registry.BY_NAME[stage]
    mod = rec.load()
    plan_reason = None if mod is None else mod.plan_reason

    def ask() -> bool:
        return not forced_fla(stage) and plan_reason is not None and plan_reason(*args, **kwargs) is None

    return _decide(rec, plan_reason, ask)


# ---------------------------------------------------------------------------------------------
# plans: a chain direction's decisions, replayed per call signature
#
# Every decision a chain direction makes (each stage's `choose`, `cute_planned`) depends only on
# what its top-level call's signature holds (every intermediate is a fresh contiguous allocation
# whose shape follows from the inputs). So `planned(...)` records them in call order the first
# time a signature is seen, and replays them on later calls: one signature per direction instead
# of one per stage (a dozen per step at 20-50 us each on the device machine's CPU). A replayed
# decision is checked against the stage it is for and the stage's current implementations; on any
# mismatch the call goes back to asking, and the stale plan is dropped (the next call records).
#
# A plan also holds each CuTe launch of the direction as a `Replay` (kda_cute._common.cache): the
# first call records what the stage's `launch` did (fresh outputs, compiled calls, where each
# tensor came from), later calls repeat it without the stage's planning, config and cache
# look-up. A module whose launch ends in torch work splits it into `launch_raw` (recorded) and
# `finish(raw, *args, **kwargs)` (run every call). A launch that cannot be replayed (a torch op
# on its tensors, the DLPack path) is recorded as such, with its reason logged once, and runs its
# `launch` on every call.

PLAN_CACHE_SIZE = 256
_plans: OrderedDict = OrderedDict()  # signature -> (((tag, state, decision), ...), launches)
_tls = threading.local()  # the plan of the chain direction running on this thread


class _Plan:
    """`replay`: the recorded decisions (None when recording, or once a replay diverged);
    `record`: the decisions being recorded (None when this call started from a recorded plan);
    `launches`: per CuTe launch in call order, (stage name, its arguments' `_form`, its Replay or
    None), recorded or being recorded."""

    __slots__ = ("replay", "record", "i", "launches", "j")

    def __init__(self, seen):
        self.replay, self.launches = (None, []) if seen is None else seen
        self.record = [] if seen is None else None
        self.i = self.j = 0

    def launch(self, name: str, mod, args, kwargs):
        """Stage `name`'s CuTe launch (module `mod`): replayed when this plan recorded one for it
        here, recorded when this plan is recording."""
        tensors = _tensors(args, kwargs)
        form = _form(args, kwargs)
        finish = getattr(mod, "finish", None)
        if self.replay is not None:
            j = self.j
            if j < len(self.launches) and self.launches[j][:2] == (name, form):
                self.j = j + 1
                rp = self.launches[j][2]
                if rp is None or not rp.usable(tensors[0]):
                    return mod.launch(*args, **kwargs)
                out = rp(tensors)
                return out if finish is None else finish(out, *args, **kwargs)
            self.replay = None  # diverged: no decision or launch is replayed from here on
            return mod.launch(*args, **kwargs)
        if torch.is_inference_mode_enabled() or any(t.is_inference() for t in tensors):
            self.launches.append((name, form, None))  # (inference tensors have no version counter)
            return mod.launch(*args, **kwargs)
        raw = mod.launch_raw if finish is not None else mod.launch
        versions = [t._version for t in tensors]
        with call_cache.recording() as r:
            out = raw(*args, **kwargs)
        rp = call_cache.Replay.of(r, tensors, versions, out)
        if isinstance(rp, str):
            log_once(f"kda_chain: {name}'s launch is not replayed: {rp}", logger=log)
            rp = None
        self.launches.append((name, form, rp))
        return out if finish is None else finish(out, *args, **kwargs)


def _form(args, kwargs) -> tuple:
    """A launch's arguments with every tensor replaced by the type torch.Tensor: where tensors and
    None's fall, and every other argument's value (what a replay must match beyond the plan's key)."""
    return (tuple(torch.Tensor if isinstance(a, torch.Tensor) else a for a in args),
            tuple((k, torch.Tensor if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()))


@contextlib.contextmanager
def planned(*args, after=None):
    """Within: the chain's decisions replay those recorded under `args`' signature, or record them
    (stored only when the block completes); yields the plan's key. `after`: the key of the plan
    whose outputs `args` are, standing for their signature (the backward after the forward: its
    saved tensors are the forward's inputs, already in that key, and its own fresh contiguous
    outputs; `args` are then only what is new: do, dht), so only the new part is computed."""
    key = _signature(args, {}) if after is None else (after, _signature(args, {}))
    key = (key, torch.is_inference_mode_enabled())  # (inference mode records no launch: its own plan)
    with _lock:
        seen = _plans.get(key)
        if seen is not None:
            _plans.move_to_end(key)  # least recently used first out
    plan = _Plan(seen)
    outer = getattr(_tls, "plan", None)
    _tls.plan = plan
    try:
        yield key
        with _lock:
            if plan.record is not None:
                _plans[key] = (tuple(plan.record), tuple(plan.launches))
                while len(_plans) > PLAN_CACHE_SIZE:
                    _plans.popitem(last=False)
            elif plan.replay is None:  # started from `seen` and diverged: drop the stale plan
                _plans.pop(key, None)
    finally:
        _tls.plan = outer


def _decide(tag, state, ask: Callable):
    """`ask()`'s answer, from the running plan when its next decision is for `tag` and was made
    with an equal `state` (what the answer depends on beyond the signature: the stage's
    implementations, the module's plan function)."""
    plan = getattr(_tls, "plan", None)
    if plan is None:
        return ask()
    if plan.replay is not None:
        if plan.i < len(plan.replay):
            t, st, d = plan.replay[plan.i]
            if t is tag and st == state:
                plan.i += 1
                return d
        plan.replay = None  # diverged: ask from here on, record nothing
        return ask()
    d = ask()
    if plan.record is not None:
        plan.record.append((tag, state, d))
    return d


def _signature(args, kwargs) -> tuple:
    """What a gate's answer depends on: per tensor its shape, strides, dtype, device and data
    pointer alignment; every other argument by value; the KDA_FORCE_FLA switch."""

    def sig(a):
        if isinstance(a, torch.Tensor):
            return (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16)
        return a

    return (tuple(sig(a) for a in args), tuple((k, sig(v)) for k, v in kwargs.items()),
            os.environ.get(FORCE_ENV, ""))


GATE_CACHE_SIZE = 1024  # decisions kept per stage (a training loop meets a handful of signatures)


@dataclass
class Stage:
    """One stage: its implementations in order. `choose` asks their gates once per call signature
    (`_signature`) and keeps the answer (a training loop pays the gates once per shape: 10-50 us
    each on the device machine's CPU, a dozen stages per step), and inside a chain call takes the
    answer from the running plan (`planned`) without computing a signature at all;
    `clear_gate_cache()` forgets both."""

    name: str
    impls: list[Impl] = field(default_factory=list)
    decided: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def choose(self, *args, **kwargs) -> tuple[Impl, str | None]:
        impls = tuple(map(id, self.impls))
        return _decide(self, impls, lambda: self._cached(impls, args, kwargs))

    def _cached(self, impls, args, kwargs) -> tuple[Impl, str | None]:
        key = (impls, _signature(args, kwargs))
        hit = self.decided.get(key)
        if hit is not None:
            return hit
        hit = self._ask(*args, **kwargs)
        self.decided[key] = hit
        while len(self.decided) > GATE_CACHE_SIZE:
            self.decided.popitem(last=False)
        return hit

    def _ask(self, *args, **kwargs) -> tuple[Impl, str | None]:
        reasons = []
        for impl in self.impls:
            r = impl.gate(*args, **kwargs)
            if r is None:
                return impl, ("; ".join(reasons) or None)
            reasons.append(f"{impl.name}: {r}")
        raise RuntimeError(f"kda stage {self.name}: no implementation accepts this call: {reasons}")

    def run(self, impl: Impl, reason: str | None, *args, **kwargs):
        """Run a chosen implementation inside its profiler range, recording the choice; a
        fallback (an implementation passed over) is also logged, once per distinct reason."""
        dispatch_log().append(Choice(self.name, impl.name, reason))
        if reason is not None:
            log_once(f"kda_chain: {self.name} runs {impl.name}: {reason}", logger=log)
        calls = _capture
        if calls is not None:
            calls.append((self.name, args, kwargs))
        if not _profiler_enabled():  # the range is for a trace: none without a profiler
            return impl.fn(*args, **kwargs)
        with stage_range(self.name, impl.name, reason):
            return impl.fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.run(*self.choose(*args, **kwargs), *args, **kwargs)

    def split(self, reason: str | None):
        """The block computes this stage from other stages instead (its CuTe kernel passed the call
        over: `reason`): recorded as the implementation "split", the block inside its range."""
        return _recorded(self.name, "split", reason,
                         f"kda_chain: {self.name} runs as separate stages: {reason}")


@contextlib.contextmanager
def _recorded(stage: str, impl: str, reason: str | None, message: str | None):
    """A block recorded as (stage, impl, reason) without going through a Stage: the choice in the
    dispatch log, `message` logged once, the block inside its profiler range."""
    dispatch_log().append(Choice(stage, impl, reason))
    if message is not None:
        log_once(message, logger=log)
    if not _profiler_enabled():
        yield
        return
    with stage_range(stage, impl, reason):
        yield


def varlen_io(impl: str, reason: str | None = None):
    """A packed call's rows: "native" where the CuTe kernels read the packed inputs and write the
    packed gradients through the chunk table, "gather" (with the reason) where the block copies
    them to or from the padded row. Recorded like a stage (`varlen_io`), the block in its range."""
    return _recorded("varlen_io", impl, reason,
                     None if reason is None else f"kda_chain: packed rows by {impl}: {reason}")


def varlen_rows(impl: str, reason: str | None = None) -> None:
    """`varlen_io`'s record where nothing runs inside it (an empty range, for the witness)."""
    with varlen_io(impl, reason):
        pass


# ---------------------------------------------------------------------------------------------
# fla adapters: our contract names -> fla 0.6.0's functions (imported lazily: fla pulls triton)


def _fla(path: str, name: str):
    return getattr(importlib.import_module(path), name)


def _fla_gate_chunk_cumsum(g, A_log, dt_bias, lower_bound, chunk_size, use_gate_in_kernel):
    from fla.ops.utils.constant import RCP_LN2

    if use_gate_in_kernel:
        f = _fla("fla.ops.kda.gate", "kda_gate_chunk_cumsum")
        return f(g=g, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=chunk_size,
                 lower_bound=lower_bound)
    f = _fla("fla.ops.utils", "chunk_local_cumsum")
    return f(g=g, scale=RCP_LN2, chunk_size=chunk_size)


def _fla_fwd_intra(q, k, v, gk, beta, scale, chunk_size, want_qg=False):
    # disable_recompute makes fla's recompute_w_u_fwd also store qg = q * exp2(gk) [B, T, HV, K]
    # in k's dtype (otherwise qg is None); nothing else changes.
    f = _fla("fla.ops.kda.chunk_intra", "chunk_kda_fwd_intra")
    return f(q=q, k=k, v=v, gk=gk, beta=beta, scale=scale, chunk_size=chunk_size,
             disable_recompute=want_qg)


def _cu_seqlens(chunks, chunk_size: int = 64):
    """fla's cu_seqlens for a chunk table (the packed row, each sequence padded to whole chunks;
    row 0 of kda_chain.varlen's [2, N + 1] `chunks`: fla's scans walk in sequence order)."""
    return None if chunks is None else chunks[0].long() * chunk_size


def _fla_fwd_h(kg, w, u, gk, initial_state, output_final_state, chunks=None):
    f = _fla("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_h")
    return f(k=kg, w=w, u=u, gk=gk, initial_state=initial_state, output_final_state=output_final_state,
             cu_seqlens=_cu_seqlens(chunks))


def _fla_fwd_o(q, v_new, gk, Aqk, h, scale):
    f = _fla("fla.ops.gla.chunk", "chunk_gla_fwd_o_gk")
    return f(q=q, v=v_new, g=gk, A=Aqk, h=h, scale=scale)


def _fla_fwd_scan(q, qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, chunks=None):
    # fla's fwd_o gates q itself: qg (the CuTe kernel's input) is not used. With a chunk table every
    # chunk lies in one sequence, so fwd_o's chunk-parallel readout needs no cu_seqlens.
    h, v_new, ht = _fla_fwd_h(kg, w, u, gk, initial_state, output_final_state, chunks)
    return _fla_fwd_o(q, v_new, gk, Aqk, h, scale), ht


def _fla_fwd_prep(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, chunk_size,
                  want_qg=False, l2norm=False):
    l2 = ()
    if l2norm:  # q, k raw: fla's l2norm_fwd of each first, its outputs after fwd_intra's
        (q, q_rstd), (k, k_rstd) = _fla_l2norm_fwd(q), _fla_l2norm_fwd(k)
        l2 = (q, k, q_rstd, k_rstd)
    gk = _fla_gate_chunk_cumsum(g, A_log, dt_bias, lower_bound, chunk_size, use_gate_in_kernel)
    return (gk, *_fla_fwd_intra(q, k, v, gk, beta, scale, chunk_size, want_qg), *l2)


def _fla_recompute_w_u(q, k, v, beta, Akk, gk):
    f = _fla("fla.ops.kda.wy_fast", "recompute_w_u_fwd")
    return f(q=q, k=k, v=v, beta=beta, A=Akk, gk=gk)


def _fla_bwd_prep(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size,
                  gk=None):
    if gk is None:  # (given: the forward's, as fla's backward takes it without the gate in the op)
        gk = _fla_gate_chunk_cumsum(g, A_log, dt_bias, lower_bound, chunk_size, use_gate_in_kernel)
    return (gk, *_fla_recompute_w_u(q, k, v, beta, Akk, gk))


def _fla_bwd_dAv(q, k, v_new, do, Aqk, scale):
    # fla's dAv kernel takes q and k but reads only their shapes (its autotune key includes
    # them, so pass the real ones to hit the tuned configs).
    f = _fla("fla.ops.kda.chunk_bwd", "chunk_kda_bwd_dAv")
    return f(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale)


def _ref_bwd_dAv(q, k, v_new, do, Aqk, scale):
    return ref.bwd_dAv(v_new, do, Aqk, scale)


def _fla_bwd_dhu(qg, kg, w, gk, h0, dht, do, dv, scale, Aqk=None, chunks=None):
    if Aqk is not None:
        raise ValueError("fla's dhu takes bwd_dAv's dv; the fused Aqk form is the CuTe kernel's "
                         "(the chain asks only it)")
    f = _fla("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_bwd_dhu")
    return f(q=qg, k=kg, w=w, gk=gk, h0=h0, dht=dht, do=do, dv=dv, scale=scale,
             cu_seqlens=_cu_seqlens(chunks))


def _fla_bwd_wy_dqkg(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, want_dAqk=False):
    if want_dAqk:
        raise ValueError("fla's wy_dqkg has no dAqk (bwd_dAv's); the chain asks only the CuTe kernel")
    f = _fla("fla.ops.kda.chunk_bwd", "chunk_kda_bwd_wy_dqkg_fused")
    return f(q=q, k=k, v=v, v_new=v_new, g=gk, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv, scale=scale)


def _fla_bwd_intra(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg=False, emit_bf16=False):
    if fold_dg or emit_bf16:
        raise ValueError("fla's intra has no fold_dg/emit_bf16; the chain asks only the CuTe kernel")
    f = _fla("fla.ops.kda.chunk_intra", "chunk_kda_bwd_intra")
    return f(q=q, k=k, g=gk, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg)


def _fla_bwd_chunk(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None,
                   k_rstd=None, g=None, A_log=None, dt_bias=None, lower_bound=None):
    if emit_bf16:
        raise ValueError("fla's kernels have no emit_bf16; the chain asks only the CuTe kernel")
    dq, dk, dv2, db, dg, dAkk = _fla_bwd_wy_dqkg(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale)
    dAqk, _ = _fla_bwd_dAv(q, k, v_new, do, Akk, scale)  # (its dA does not read A)
    dq, dk, db, dg = _fla_bwd_intra(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg)
    if q_rstd is not None:
        dq, dk = _fla_l2norm_bwd(q, q_rstd, dq), _fla_l2norm_bwd(k, k_rstd, dk)
    dg = _fla_dg_cumsum(dg, 64)
    dA_log = ddt_bias = None
    if A_log is not None:  # the gate in the op: its backward too (kda_gate_bwd)
        dg, dA_log, ddt_bias = _fla_gate_bwd(g, A_log, dt_bias, dg, lower_bound)
    return dq, dk, dv2, db, dg, dA_log, ddt_bias


def _fla_dg_cumsum(dg, chunk_size):
    return _fla("fla.ops.utils", "chunk_local_cumsum")(dg, chunk_size=chunk_size, reverse=True)


def _fla_l2norm_fwd(x):
    return _fla("fla.modules.norm.l2norm", "l2norm_fwd")(x)


def _fla_l2norm_bwd(y, rstd, dy):
    # dy's GVA form [B, T, G*H, K] (a gradient per value head): summed per group first, as fla does
    if dy.shape != y.shape:
        dy = ref.gva_sum(dy, y.shape[2])
    return _fla("fla.modules.norm.l2norm", "l2norm_bwd")(y, rstd, dy)


def _fla_beta_sigmoid_fwd(x, scale):
    return _fla("fla.ops.common.gate", "fused_beta_sigmoid_fwd")(x, scale)


def _fla_beta_sigmoid_bwd(x, dy, scale):
    return _fla("fla.ops.common.gate", "fused_beta_sigmoid_bwd")(x, dy, scale)


def _fla_gate_bwd(g, A_log, dt_bias, dyg, lower_bound):
    f = _fla("fla.ops.kda.gate", "kda_gate_bwd")
    return f(g=g, A_log=A_log, dt_bias=dt_bias, dyg=dyg, lower_bound=lower_bound)


# ---------------------------------------------------------------------------------------------
# the table


def _ref(fn_name: str) -> Callable:
    """The reference function, looked up per call (kda_cute.reference is the oracle)."""

    def call(*args, **kwargs):
        return getattr(ref, fn_name)(*args, **kwargs)

    call.__name__ = fn_name
    return call


def _two(name: str, fla_fn: Callable) -> Stage:
    return Stage(name, [Impl("fla", fla_gate, fla_fn), Impl("reference", _always, _ref(name))])


# fla's function for every CuTe stage of kda_cute.registry (the per-stage fallback)
_FLA_OF_CUTE = {"l2norm_fwd": _fla_l2norm_fwd, "fwd_prep": _fla_fwd_prep, "fwd": _fla_fwd_scan,
                "bwd_prep": _fla_bwd_prep, "b1": _fla_fwd_h, "dhu": _fla_bwd_dhu,
                "bwd_wy_dqkg": _fla_bwd_wy_dqkg, "intra": _fla_bwd_intra, "bwd_chunk": _fla_bwd_chunk,
                "l2norm_bwd": _fla_l2norm_bwd}
# The stages with a CuTe kernel, one per registry record: kda_cute.<name>, then fla, then the reference.
CUTE_STAGES = {
    rec.name: Stage(rec.name, [cute_impl(rec), Impl("fla", fla_gate, _FLA_OF_CUTE[rec.name]),
                               Impl("reference", _always, _ref(rec.contract))])
    for rec in registry.STAGES
}
# what the witness expects a chain call to launch (its CLI, `expect`, the pytest marker)
kda_witness.register_kernels(registry.chain_kernels())

fwd_prep = CUTE_STAGES["fwd_prep"]
fwd = CUTE_STAGES["fwd"]
bwd_prep = CUTE_STAGES["bwd_prep"]
b1 = CUTE_STAGES["b1"]
bwd_dAv = Stage("bwd_dAv", [Impl("fla", fla_gate, _fla_bwd_dAv), Impl("reference", _always, _ref_bwd_dAv)])
dhu = CUTE_STAGES["dhu"]
bwd_wy_dqkg = CUTE_STAGES["bwd_wy_dqkg"]
intra = CUTE_STAGES["intra"]
bwd_chunk = CUTE_STAGES["bwd_chunk"]
dg_cumsum = _two("dg_cumsum", _fla_dg_cumsum)
# fla sums the GVA group with a torch view + sum too: one implementation on every device.
gva_sum = Stage("gva_sum", [Impl("reference", _always, _ref("gva_sum"))])
l2norm_fwd = CUTE_STAGES["l2norm_fwd"]
l2norm_bwd = CUTE_STAGES["l2norm_bwd"]
beta_sigmoid_fwd = _two("beta_sigmoid_fwd", _fla_beta_sigmoid_fwd)
beta_sigmoid_bwd = _two("beta_sigmoid_bwd", _fla_beta_sigmoid_bwd)
gate_bwd = _two("gate_bwd", _fla_gate_bwd)

STAGES = {
    s.name: s
    for s in (fwd_prep, fwd, bwd_prep, b1, bwd_dAv, dhu, bwd_chunk, bwd_wy_dqkg, intra,
              dg_cumsum, gva_sum, l2norm_fwd, l2norm_bwd, beta_sigmoid_fwd, beta_sigmoid_bwd, gate_bwd)
}
