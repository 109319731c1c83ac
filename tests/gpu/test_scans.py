"""GPU correctness of the sm_90 scans (kda_cute_b1 / kda_cute_fwd / kda_cute_dhu) against fla 0.6.0
and the float64 reference: every output within 2x fla's error, finite after NaN-poisoned allocation,
bitwise repeatable. Inputs and comparisons are bench/check_scans.py's. Skips without CUDA."""

import importlib.util
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("fla")
pytest.importorskip("cutlass.cute")

_path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "check_scans.py"
_spec = importlib.util.spec_from_file_location("check_scans", _path)
cs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cs)

SHAPES = {
    "h0_dht": (2, 256, 16, 16, 128, torch.bfloat16, True),
    "one_chunk": (1, 64, 16, 16, 256, torch.bfloat16, False),
    "gva_tail": (2, 200, 8, 16, 128, torch.bfloat16, True),
    "fp16": (2, 256, 16, 16, 128, torch.float16, True),
}


@pytest.fixture(autouse=True)
def _no_floor(monkeypatch):
    for m in cs.MODS:
        monkeypatch.setattr(m, "GRID_FLOOR", 0)


@pytest.mark.parametrize("name", list(SHAPES))
def test_scans_match_fla_error(name):
    B, T, H, HV, V, dt, h0 = SHAPES[name]
    assert cs.check_shape(name, B, T, H, HV, V, dt, h0)
