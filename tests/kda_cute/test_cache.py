"""The call cache's CPU-checkable contract: views, retarget, keepalive release, the two levels."""

import ctypes
import gc
import re

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

cache = pytest.importorskip("kda_cute._common.cache")
pytest.importorskip("cutlass.cute")


def _ptr(ct) -> int:
    return ctypes.c_uint64.from_address(ct.__c_pointers__()[0]).value


def test_view_marks_batch_and_time_dynamic():
    t = torch.randn(2, 64, 4, 32)
    ct = cache.cute_view(t, (0, 1))
    s = str(ct)
    assert "(?,?,4,32)" in s, s


def test_view_pins_its_tensor_until_released():
    t = torch.randn(2, 64, 4, 32)
    ct = cache.cute_view(t, (0, 1))
    storage = StorageWeakRef(t.untyped_storage())  # the memory, not the Python object
    del t
    gc.collect()
    assert not storage.expired(), "DLPack keeps the exporter alive (the reason release exists)"
    cache.release_keepalives(ct)
    gc.collect()
    assert storage.expired(), "a released view must not pin the caller's memory"


def test_retarget_rewrites_the_data_pointer():
    t = torch.randn(2, 64, 4, 32)
    ct = cache.cute_view(t, (0, 1))
    cache.release_keepalives(ct)
    t2 = torch.randn(2, 64, 4, 32)
    cache.retarget(cache.pointer_cell(ct), t2)
    assert _ptr(ct) == t2.data_ptr()


def test_misaligned_storage_is_refused():
    t = torch.randn(1025)[1:]  # 4-byte offset
    with pytest.raises(ValueError, match="aligned"):
        cache.cute_view(t)


class _FakeCompiled:
    def __init__(self):
        self.calls = []

    def __call__(self, *views_and_stream):
        *views, stream = views_and_stream
        self.calls.append(tuple(_ptr(v) for v in views))


@pytest.fixture
def cpu_stream(monkeypatch):
    state = {"handle": 7}
    monkeypatch.setattr(cache, "current_stream", lambda device: (state["handle"], None))
    return state


def test_call_cache_compiles_once_marshals_per_shape_and_pins_nothing(cpu_stream, caplog):
    caplog.set_level("INFO", logger="kda_cute")
    cc = cache.CallCache("test")
    built = []

    def build(views, stream, options):
        built.append(len(views))
        return _FakeCompiled()

    def call(B, T):
        a = torch.randn(B, T, 4, 32)
        out = cache.alloc((B, T, 4, 32), torch.float32, a)
        cc.launch(("k", 32), (a, out), ((0, 1), (0, 1)), build)
        return a, out

    a1, o1 = call(2, 64)
    a2, o2 = call(2, 64)
    assert cc.compiles == 1 and cc.marshals == 1
    said = [r.getMessage() for r in caplog.records]
    assert sum("compiling test" in m for m in said) == 1 and sum("compiled test in" in m for m in said) == 1
    compiled = cc.compiled[(("k", 32), None)]  # (compile key, device index): CPU has none
    assert compiled.calls[-1] == (a2.data_ptr(), o2.data_ptr()), "second call must retarget"
    assert o1.data_ptr() != o2.data_ptr(), "outputs are fresh per call"
    call(3, 128)  # new B/T: a new view entry, the same compiled object
    assert cc.compiles == 1 and cc.marshals == 2
    cpu_stream["handle"] = 8  # another stream: new entry
    call(2, 64)
    assert cc.marshals == 3

    first = [StorageWeakRef(t.untyped_storage()) for t in (a1, o1)]
    del a1, o1
    gc.collect()
    assert all(s.expired() for s in first), "a tensor handed to a cached call is freed when dropped"


def test_view_entries_are_bounded_least_recently_used_first(cpu_stream):
    """Shapes that change every step (packed batches) must not grow the view level forever."""
    cc = cache.CallCache("bounded", max_entries=3)

    def call(T):
        a = torch.randn(1, T, 4, 32)
        cc.launch(("k", 32), (a,), ((0, 1),), lambda views, stream, options: _FakeCompiled())

    for T in (64, 128, 192):
        call(T)
    call(64)  # a hit: 64 becomes the most recent
    call(256)  # evicts 128, the least recently used
    assert len(cc.entries) == 3 and cc.marshals == 4 and cc.compiles == 1
    call(64)
    assert cc.marshals == 4, "a kept shape is not re-marshalled"
    call(128)
    assert cc.marshals == 5, "an evicted shape is marshalled again"


def test_one_compiled_kernel_per_device(cpu_stream, monkeypatch):
    """A compiled kernel lives in one device's context: a second device compiles its own."""
    import ctypes
    from types import SimpleNamespace

    monkeypatch.setattr(cache, "cute_view", lambda t, d: object())
    monkeypatch.setattr(cache, "release_keepalives", lambda *cts: None)
    monkeypatch.setattr(cache, "pointer_cell", lambda ct: ctypes.c_uint64())
    cc = cache.CallCache("devices")

    def fake(index):  # what launch reads of a tensor, on "device" `index` (not CUDA: no switch)
        return SimpleNamespace(device=SimpleNamespace(type="cpu", index=index), shape=(1, 64),
                               stride=lambda: (64, 1), dtype=torch.float32, data_ptr=lambda: 4096)

    launched = []
    for index in (0, 0, 1):
        cc.launch(("k",), (fake(index),), ((0,),), lambda v, s, o: lambda *a: launched.append(1))
    assert cc.compiles == 2 and {k[1] for k in cc.compiled} == {0, 1} and len(launched) == 3


# --------------------------------------------------------------------------- recorded launches


@pytest.fixture
def tvm_ffi_path(monkeypatch):
    """The TVM-FFI launch path on CPU: every compiled kernel a recorder of the tensors it gets."""
    got = []

    def kernel(*tensors):
        got.append(tensors)

    def compile_(self, ckey, args, dyn_modes, build):
        self.compiled[ckey] = kernel
        self.path = "tvm-ffi"
        return kernel

    monkeypatch.setattr(cache, "launch_path", lambda: "tvm-ffi")
    monkeypatch.setattr(cache.CallCache, "_compile_tvm_ffi", compile_)
    return got


def _record(launch, *inputs):
    versions = [t._version for t in inputs]
    with cache.recording() as rec:
        out = launch(*inputs)
    return out, cache.Replay.of(rec, inputs, versions, out)


def test_a_replay_repeats_the_launch_with_fresh_outputs_views_and_constants(tvm_ffi_path):
    cc = cache.CallCache("replay")
    placeholder = cache.constant(torch.zeros(2))

    def launch(a, b):  # a view of an argument, a constant, two fresh outputs, one unused result slot
        o1 = cache.alloc((a.shape[0], 3), torch.float32, a)
        o2 = cache.alloc((5,), torch.int32, a)
        cc.launch("k", (a[:, 1:].detach(), b, placeholder, o1, o2), ((),) * 5, None)
        return o1, None, o2.view(5, 1)

    a, b = torch.randn(4, 6)[1:], torch.randn(3)
    out, rp = _record(launch, a, b)
    assert isinstance(rp, cache.Replay), rp
    a2, b2 = torch.randn(4, 6)[1:], torch.randn(3)
    o1, none, o2 = rp([a2, b2])
    assert none is None and o1.shape == (3, 3) and o1.dtype == torch.float32 and o2.shape == (5, 1)
    assert o1.data_ptr() not in (out[0].data_ptr(), out[2].data_ptr()), "outputs are fresh per call"
    view, bb, c, p1, p2 = tvm_ffi_path[-1]
    assert view.data_ptr() == a2[:, 1:].data_ptr() and view.shape == a2[:, 1:].shape
    assert view.stride() == a2.stride() and bb is b2 and c is placeholder
    assert p1 is o1 and p2.data_ptr() == o2.data_ptr()


def test_a_launch_a_replay_cannot_repeat_says_why(tvm_ffi_path, cpu_stream, monkeypatch):
    cc = cache.CallCache("refused")
    a = torch.randn(4, 3)

    def call(*tensors, cc=cc):
        cc.launch("k", tensors, ((),) * len(tensors), None)

    def torch_op_result(x):  # a torch op's result handed to the kernel: a replay would reuse it
        call(x * 2)
        return x

    def written(x):
        x.add_(1)
        call(x)
        return x

    def not_an_output(x):
        y = torch.empty(3)
        call(x)
        return y

    for fn, why in ((torch_op_result, "no argument's view"), (written, "written by a torch op"),
                    (not_an_output, "result .* no argument's view")):
        _, rp = _record(fn, a)
        assert isinstance(rp, str) and re.search(why, rp), (fn.__name__, rp)

    dl = cache.CallCache("dlpack", path="dlpack")  # descriptors retargeted per call: not replayable
    dl.compiled[("k", None)] = lambda *views_and_stream: None
    monkeypatch.setattr(cache, "cute_view", lambda t, d: object())
    monkeypatch.setattr(cache, "release_keepalives", lambda *cts: None)
    monkeypatch.setattr(cache, "pointer_cell", lambda ct: ctypes.c_uint64())
    _, rp = _record(lambda x: (dl.launch("k", (x,), ((),), None), x)[1], a)
    assert rp == "the DLPack launch path"
