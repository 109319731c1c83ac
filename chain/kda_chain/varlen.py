"""Packed sequences (fla's `cu_seqlens`) on the chain: each sequence padded to whole chunks.

A packed call's tokens [1, total_T, ...] are copied into a row where every sequence starts on a
chunk boundary and its last chunk is filled with padding tokens that change nothing:

    q, k, v = 0, beta = 0 (or -inf before the in-op sigmoid), log gate = 0 (or, with the gate in
    the op, a raw gate of -1e30, whose softplus / sigmoid form is exactly 0)

so a padding row adds zero to every product, leaves gk at the sequence's last token (the chunk's
decay is the last valid token's) and its outputs are dropped again. On that row every
chunk-parallel stage (prep, wy_dqkg, intra, fla's gate / l2norm / cumsum stages) runs unchanged as
one batch row, and the three state scans (b1, fwd, dhu) walk each sequence's chunks from a chunk
table `chunks` (int32 [2, N + 1]: row 0 the chunk offsets, row 1 the walk order; fla's own scans
get `chunks[0] * 64` as cu_seqlens): one CTA per (V tile, head, sequence), states [N, HV, K, V].
The walk order puts the longest sequences first (grid z = their rank): the scans' CTAs of
unequal lengths start longest first, so the short ones fill the tail (`walk_order`). The result
is fla's: fla's varlen chunks also restart at every sequence start.

Cost: the copies in and out (inputs, o, and in the backward do and the gradients), about 10% of a
step at the reference shape, where a call goes through the custom ops (traced); an eager call
copies none of them (`Native`: the kernels read and write the packed row through the chunk
table). The pad rows (< 64 per sequence) cost either way. The layout needs the offsets on the
host (`cu_seqlens_cpu` when given, else one `cu_seqlens.tolist()`: a host sync, as fla's own
varlen path without cu_seqlens_cpu); its tables are built there and copied over once (`packing`).
"""

from __future__ import annotations

import struct
import weakref
from itertools import accumulate

import torch

BT = 64
GATE_PAD = -1e30  # a raw gate whose step gate is exactly 0 in both of fla's forms (see module doc)


class Packing:
    """A packed call's layouts. Built at once (what the kernels read): `chunks` (int32 [2, N + 1]:
    row 0 the chunk offsets on the padded row, row 1 the scans' walk order, `walk_order`, then a 0)
    and `table` (int32 [T_pad / 64, 2], per chunk of
    the padded row its first packed token and its valid rows 1..64, the pad rows after them:
    kda_cute_prep / fwd / dhu / bwd_chunk read and write the packed row through it), on the
    device; `T` (total_T) and `T_pad`, the padded length. Built on first use from the table (only
    where a row is gathered: a stage that does not take the packed row, a traced call): `index`
    (int64 [total_T], each token's row in the padded layout), `source` (int64 [T_pad], each padded
    row's token, 0 for a pad row), `pad` (int64, the pad rows). Nothing here refers to the
    caller's cu_seqlens, which it may refill before the backward."""

    __slots__ = ("T", "T_pad", "chunks", "table", "_rows")

    def __init__(self, T: int, T_pad: int, chunks: torch.Tensor, table: torch.Tensor):
        self.T, self.T_pad, self.chunks, self.table = T, T_pad, chunks, table
        self._rows = None

    @property
    def N(self) -> int:
        return self.chunks.shape[1] - 1

    def _gathers(self) -> tuple:
        if self._rows is None:
            self._rows = _rows(self.table, self.T, self.T_pad)
        return self._rows

    @property
    def index(self) -> torch.Tensor:
        return self._gathers()[0]

    @property
    def source(self) -> torch.Tensor:
        return self._gathers()[1]

    @property
    def pad(self) -> torch.Tensor:
        return self._gathers()[2]


def _rows(table: torch.Tensor, T: int, T_pad: int) -> tuple:
    """(index, source, pad) of `Packing`, from its chunk table, on the table's device (no sync:
    T and T_pad come from the host). Padded row 64 c + r is token table[c, 0] + r when r <
    table[c, 1], else a pad row; a stable sort of the rows by validity puts the pad rows first and
    the valid ones after them in token order (the packed order is the padded row's)."""
    dev = table.device
    rows = torch.arange(T_pad, device=dev)
    c, r = rows // BT, rows % BT
    valid = r < table[c, 1]
    source = torch.where(valid, table[c, 0].to(torch.int64) + r, 0)
    order = torch.sort(valid.to(torch.uint8), stable=True).indices
    return order[T_pad - T:], source, order[:T_pad - T]


def walk_order(counts: list[int]) -> list[int]:
    """The scans' walk order: the sequences by chunk count, longest first (ties in sequence
    order). The scans' grid z is the rank in it. A scan CTA walks its sequence's chunks serially,
    and the GPU starts CTAs in grid order: in sequence order a long sequence drawn last would run
    alone at the end, in this order the short ones fill the tail (longest-processing-time-first
    list scheduling; at the reference grid, 30 sequences of 1..8192 tokens, a model of the SMs'
    slots puts the walk at 1.03x the dense batch's in this order, 1.23x in sequence order)."""
    return sorted(range(len(counts)), key=lambda i: -counts[i])


def chunks_words(counts: list[int]) -> list[int]:
    """`chunks` [2, N + 1] flat from the sequences' chunk counts: the N + 1 chunk offsets, then
    the walk order and a 0 (`torch.tensor(.., dtype=torch.int32).view(2, -1)` is the scans'
    table; the tests build theirs here)."""
    return [*accumulate(counts, initial=0), *walk_order(counts), 0]


def _offsets_at(NT: int) -> int:
    """Where the chunk offsets start in the tables' buffer (int32 elements): after the [NT, 2]
    chunk table, on a 16-byte boundary."""
    return -(-2 * NT // 4) * 4


def _tables(cu: torch.Tensor, NT: int) -> torch.Tensor:
    """The kernels' two tables in one int32 buffer on cu's device: the chunk table [NT, 2] (each
    chunk's first packed token and valid rows) at 0, then `chunks` [2, N + 1] (the chunk offsets,
    then the walk order and a 0) from a 16-byte boundary (`_split`). cu: int64 token offsets
    [N + 1]; NT: the chunk count (from the host)."""
    N = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    at = _offsets_at(NT)
    buf = torch.zeros(at + 2 * (N + 1), dtype=torch.int32, device=cu.device)
    chunks = buf[at:at + N + 1]
    counts = (lens + BT - 1) // BT
    torch.cumsum(counts, 0, out=chunks[1:])
    buf[at + N + 1:at + 2 * N + 1] = torch.sort(counts, descending=True, stable=True).indices
    seq = torch.repeat_interleave(torch.arange(N, device=cu.device), (lens + BT - 1) // BT, output_size=NT)
    row = (torch.arange(NT, device=cu.device) - chunks[:-1][seq]) * BT  # its first row in its sequence
    table = buf[:2 * NT].view(NT, 2)
    table[:, 0] = cu[seq] + row
    table[:, 1] = torch.clamp(lens[seq] - row, max=BT)
    return buf


def _host_tables(offsets: list[int], counts: list[int], NT: int) -> torch.Tensor:
    """`_tables`' buffer built in plain Python from the host offsets (a CPU tensor over the packed
    bytes). Plain Python, not torch's CPU ops: a dozen of those cost ~90 us here on an idle CPU and
    5-7x that when other processes keep the cores busy (a training job's data loaders); this is
    ~100 us at 2065 chunks in 30 sequences (list slices and one struct.pack: ~25% under an array
    per column)."""
    first, nv = [], []
    for a, b, n in zip(offsets, offsets[1:], counts, strict=False):
        if n:
            first += range(a, b, BT)
            nv += [BT] * (n - 1)
            nv.append(b - a - BT * (n - 1))
    at = _offsets_at(NT)
    words = [0] * at
    words[0:2 * NT:2], words[1:2 * NT:2] = first, nv
    words += chunks_words(counts)
    return torch.frombuffer(bytearray(struct.pack(f"={len(words)}i", *words)), dtype=torch.int32)


def _split(buf: torch.Tensor, NT: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_tables`' buffer -> (chunks, table), views of it."""
    at = _offsets_at(NT)
    return buf[at:].view(2, -1), buf[:2 * NT].view(NT, 2)


def packing(cu_seqlens: torch.Tensor, offsets: list[int], host: bool = True) -> Packing:
    """The padded layout of sequences with token offsets `cu_seqlens` (N + 1, on the device) whose
    host copy is `offsets`. host (an eager call): the tables are computed on the CPU from the
    offsets (`_host_tables`) and copied over once from pinned memory without waiting (a dozen tiny
    device kernels and their launches were ~40% of a packed step's host time, all of it before the
    first kernel of substance); under CUDA-graph capture, or host=False (a traced call), they are
    computed on the device from cu_seqlens (a captured copy would re-read a host buffer freed
    after capture)."""
    dev = cu_seqlens.device
    counts = [-(-(b - a) // BT) for a, b in zip(offsets, offsets[1:], strict=False)]
    T, NT = offsets[-1], sum(counts)
    if NT == 0:  # every sequence empty: no chunk
        chunks = torch.zeros(2, len(counts) + 1, dtype=torch.int32, device=dev)
        chunks[1, :-1] = torch.arange(len(counts))
        return Packing(T, 0, chunks, torch.zeros(0, 2, dtype=torch.int32, device=dev))
    on_host = host and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if on_host:
        buf = _host_tables(offsets, counts, NT)
        if dev.type == "cuda":
            buf = buf.pin_memory().to(dev, non_blocking=True)
    else:
        buf = _tables(cu_seqlens.to(torch.int64), NT)
    return Packing(T, BT * NT, *_split(buf, NT))


_BY_CU: dict = {}  # id(cu_seqlens) -> (a weak reference to it, its offsets, version, stream, Packing)


def packing_of(cu_seqlens: torch.Tensor, offsets: list[int], host: bool = True) -> Packing:
    """`packing`, kept while the caller's cu_seqlens tensor lives: the calls of one step's layers
    (the same cu_seqlens object, unchanged: the same host offsets and version, on the same
    stream) share one build, as fla shares its chunk indices per cu_seqlens (~0.2-0.7 ms of host
    time per call at 131072 tokens in 30 sequences on the device machine, all of it before the
    first kernel). Only eager host builds are kept (not a traced or captured call's), and nothing
    outlives cu_seqlens itself: a weak reference's callback drops the entry."""
    dev = cu_seqlens.device
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not host or cu_seqlens.is_inference() or capturing:
        return packing(cu_seqlens, offsets, host)
    stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    key, ver = id(cu_seqlens), cu_seqlens._version
    hit = _BY_CU.get(key)
    if hit is not None:
        ref, offs, v0, st, p = hit
        if ref() is cu_seqlens and v0 == ver and st == stream and offs == offsets:
            return p
    p = packing(cu_seqlens, offsets, host)
    ref = weakref.ref(cu_seqlens, lambda _, k=key: _BY_CU.pop(k, None))
    _BY_CU[key] = (ref, list(offsets), ver, stream, p)
    return p


def _gather(x: torch.Tensor, rows: torch.Tensor, pad=None, fill: float = 0.0) -> torch.Tensor:
    """x [1, R, ...] -> [1, len(rows), ...], row i = x[0, rows[i]] (then the `pad` rows = fill).
    Every copy here is this gather: index_select's row gather runs at copy speed, where
    index_copy_ (and autograd's index_select backward, an atomic index_add) ran ~3x slower
    (5.6 ms of a 28.7 ms step at 131072 tokens, H200)."""
    y = x.new_empty(1, rows.numel(), *x.shape[2:])  # (not a view: the caller may change it in place)
    out = torch.index_select(x.reshape(x.shape[1], -1), 0, rows, out=y.view(rows.numel(), -1))
    if pad is not None and pad.numel():
        out.index_fill_(0, pad, fill)
    return y


class _Pack(torch.autograd.Function):
    """x [1, T, ...] -> the padded row [1, T_pad, ...]; its gradient gathers the rows back. The
    rows come as arguments, not through the Packing (whose lazily built rows would be a side
    effect torch.compile cannot trace inside the backward)."""

    @staticmethod
    def forward(ctx, x, index, source, pad, fill: float):
        ctx.save_for_backward(index)
        return _gather(x, source, pad, fill)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return _gather(g, index), None, None, None, None


class _Unpack(torch.autograd.Function):
    """The padded row [1, T_pad, ...] -> [1, T, ...] (pad rows dropped); its gradient is a pack
    with zeros in the pad rows (the rows as arguments: `_Pack`)."""

    @staticmethod
    def forward(ctx, y, index, source, pad):
        ctx.save_for_backward(source, pad)
        return _gather(y, index)

    @staticmethod
    def backward(ctx, g):
        source, pad = ctx.saved_tensors
        return _gather(g, source, pad, 0.0), None, None, None


def pack(x: torch.Tensor, p: Packing, fill: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, total_T, ...] -> [1, T_pad, ...] (pad rows = `fill`; in `dtype` if given), differentiable."""
    x = x if dtype is None else x.to(dtype)
    return _Pack.apply(x, p.index, p.source, p.pad, fill)


def unpack(y: torch.Tensor, p: Packing) -> torch.Tensor:
    """y [1, T_pad, ...] -> [1, total_T, ...] (the pad rows dropped), differentiable."""
    return _Unpack.apply(y, p.index, p.source, p.pad)


def gate_fill(g_dtype: torch.dtype, use_gate_in_kernel: bool, lower_bound,
              ) -> tuple[float, torch.dtype | None]:
    """The raw gate's pad value on the padded row, and the dtype it needs there (None: g's own).
    -1e30 overflows fp16: a raw fp16 gate pads with -inf in the softplus form (softplus(-inf) = 0,
    its gradient 0), and goes to fp32 in the lower_bound form (whose A_log gradient would be
    0 * -inf)."""
    if not use_gate_in_kernel:
        return 0.0, None
    if g_dtype == torch.float16:
        return (float("-inf"), None) if lower_bound is None else (GATE_PAD, torch.float32)
    return GATE_PAD, None


def pack_inputs(q, k, v, g, beta, p: Packing, *, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                lower_bound) -> tuple:
    """q, k, v, g, beta on the padded row, each pad row a no-op token (module doc; `gate_fill`),
    differentiable."""
    g_fill, g_dtype = gate_fill(g.dtype, use_gate_in_kernel, lower_bound)
    b_fill = float("-inf") if use_beta_sigmoid_in_kernel else 0.0
    return (pack(q, p), pack(k, p), pack(v, p), pack(g, p, g_fill, g_dtype), pack(beta, p, b_fill))


def pad_inputs(q, k, v, g, beta, p: Packing, *, use_gate_in_kernel: bool, lower_bound) -> tuple:
    """`pack_inputs` without autograd, beta already activated (its pad rows 0): where the packed
    forward's CuTe prep does not take a call (`Native`)."""
    g_fill, g_dtype = gate_fill(g.dtype, use_gate_in_kernel, lower_bound)
    g = g if g_dtype is None else g.to(g_dtype)
    return (_gather(q, p.source, p.pad), _gather(k, p.source, p.pad), _gather(v, p.source, p.pad),
            _gather(g, p.source, p.pad, g_fill), _gather(beta, p.source, p.pad))


def to_padded(x: torch.Tensor, p: Packing, fill: float = 0.0) -> torch.Tensor:
    """x on the packed row [1, total_T, ...] -> the padded row (pad rows `fill`), not
    differentiable: a packed call's do, v, raw gate or beta for a backward stage that does not read
    the packed row itself."""
    return _gather(x, p.source, p.pad, fill)


def to_packed(x: torch.Tensor | None, p: Packing) -> torch.Tensor | None:
    """A gradient on the packed row: x itself when it is there already (kda_cute_bwd_chunk wrote
    it through the chunk table), else gathered from the padded row."""
    if x is None or x.shape[1] == p.T:
        return x
    return _gather(x, p.index)


class Native(torch.autograd.Function):
    """A packed call whose inputs the chain reads on the packed row itself (forward.py's module
    doc: kda_cute_prep through the chunk table) and whose gradients kda_cute_bwd_chunk writes there
    (backward.py), kda_cute_fwd writes o there and kda_cute_dhu / kda_cute_bwd_chunk read do there:
    nothing is gathered where every kernel takes the call (each gather that runs instead is
    recorded with its reason). Eager calls only (api.py); a traced call goes through the custom ops
    on `pack_inputs`' row."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, f, p: Packing):
        from .autograd import device_guard
        from .forward import forward

        with device_guard(q):
            o, ht, s = forward(q, k, v, g, beta, A_log, dt_bias, initial_state, f, chunks=p.chunks, packing=p)
        names = [n for n, t in vars(s).items() if isinstance(t, torch.Tensor)]
        kept = () if s.kept is None else tuple(vars(s.kept).items())
        ctx.save_for_backward(*(getattr(s, n) for n in names), *(t for _, t in kept))
        ctx.names, ctx.kept_names = names, [n for n, _ in kept]
        s.kept = None
        for n in names:
            setattr(s, n, None)
        ctx.shell, ctx.f, ctx.p = s, f, p
        ctx.o_form = ((1, p.T, *o.shape[2:]), o.dtype)
        ins = (q, k, v, g, beta, A_log, dt_bias, initial_state)
        ctx.likes = [None if t is None else t.dtype for t in ins]
        ctx.set_materialize_grads(False)
        # (kda_cute_fwd wrote o on the packed row, else the forward recorded why it did not)
        return (o if o.shape[1] == p.T else _gather(o, p.index)), ht

    @staticmethod
    def backward(ctx, do, dht):
        import dataclasses

        from .autograd import device_guard
        from .backward import backward
        from .forward import Kept
        from .op import _as

        f = ctx.f
        ts = ctx.saved_tensors
        n = len(ctx.names)
        s = dataclasses.replace(ctx.shell, **dict(zip(ctx.names, ts[:n], strict=True)))
        if ctx.kept_names:
            s.kept = Kept(**dict(zip(ctx.kept_names, ts[n:], strict=True)))
        if do is None:  # o unused by the loss (only ht is)
            do = torch.zeros(ctx.o_form[0], dtype=ctx.o_form[1], device=s.Aqk.device)
        else:  # (on the packed row: the backward's kernels read it there, or gather it: backward.py)
            do = do.contiguous()
        dht = None if not f.output_final_state or dht is None else dht.contiguous()
        with device_guard(do):  # (the gradients come out on the packed row: backward.py)
            grads = backward(do, dht, s, f)
        out = [None if gr is None or dt is None or (i in (5, 6) and not f.use_gate_in_kernel) else _as(gr, dt)
               for i, (gr, dt) in enumerate(zip(grads, ctx.likes, strict=True))]
        return (*out, None, None)
