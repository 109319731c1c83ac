"""Attribution on a hand-written CUDA Chrome trace (witness_trace_fixture.json), no GPU needed.

The fixture has: CuTe kernels launched inside kda::fwd/b1/intra::cute ranges (fwd on the main
thread, the rest on an autograd thread, each kernel running after its CPU range closed, so only
correlation attributes them right); an fla kernel inside `kda::dhu::fla::kernel not built yet`
(plus its GPU projection, which must not double count); a nested kda::dg_cumsum range inside
intra; a kernel outside every range; a kernel found only through its External id (a cuBLAS
GEMM in kda::bwd_dAv); and a kernel with no launch event inside a GPU-only range.
"""

import json
from pathlib import Path

import pytest
from kda_witness import Results, WitnessError, expect

FIXTURE = Path(__file__).with_name("witness_trace_fixture.json")


@pytest.fixture
def res() -> Results:
    return Results.from_chrome_trace(FIXTURE)


def test_stage_rows(res):
    got = [(r.stage, r.impl, r.reason, r.calls, [n for n, _, _ in r.kernels]) for r in res.stages]
    assert got == [
        ("fwd", "cute", None, 1, [n for n in _names() if "kda_cute_fwd" in n]),
        ("b1", "cute", None, 1, [n for n in _names() if "kda_cute_b1" in n]),
        ("dhu", "fla", "kernel not built yet", 1, ["chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"]),
        ("intra", "cute", None, 1, [n for n in _names() if "kda_cute_intra" in n]),
        ("dg_cumsum", "fla", None, 1, ["chunk_local_cumsum_vector_kernel"]),
        ("bwd_dAv", "fla", None, 1, ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"]),
        ("wy_dqkg", "fla", None, 1, ["chunk_kda_bwd_kernel_wy_dqkg_fused"]),
    ]
    ms = {r.stage: res.row_ms(r) for r in res.stages}
    assert ms == pytest.approx({"fwd": 1.0, "b1": 0.8, "dhu": 2.95, "intra": 0.05, "dg_cumsum": 0.58,
                                "bwd_dAv": 0.1, "wy_dqkg": 1.0})
    assert res.has_kernels and res.time_source == "device"
    assert res.total_ms == pytest.approx(6.48)


def test_outside_and_fallbacks(res):
    assert [(k.name[:9], k.count) for k in res.outside] == [("void at::", 1)]
    assert [(r.stage, r.reason) for r in res.fallbacks()] == [("dhu", "kernel not built yet")]
    assert [k.stage for k in res.launched("kda_cute_")] == ["fwd", "b1", "intra"]


def test_expect_names_fallbacks(res):
    expect(res, ("kda_cute_fwd", "kda_cute_b1", "kda_cute_intra"))
    with pytest.raises(WitnessError) as e:
        expect(res)
    msg = str(e.value)
    assert "kda_cute_dhu (stage dhu)" in msg
    assert "dhu -> fla: kernel not built yet" in msg
    assert "kda_cute_intra" not in msg.splitlines()[0]


def test_table_and_rows(res):
    text = res.table()
    assert "NO CUDA" not in text
    for word in ("kda_cute_fwd", "kda_cute_intra", "kernel not built yet", "(outside kda ranges)"):
        assert word in text
    rows = res.rows()
    assert rows[2]["stage"] == "dhu" and rows[2]["reason"] == "kernel not built yet"
    assert {r["time_source"] for r in rows} == {"device"}


def test_from_events_and_export(res, tmp_path):
    events = json.loads(FIXTURE.read_text())["traceEvents"]
    assert Results.from_chrome_trace(events).rows() == res.rows()
    out = tmp_path / "t.json"
    res.export_chrome_trace(out)
    assert Results.from_chrome_trace(out).rows() == res.rows()


def _names():
    return [e["name"] for e in json.loads(FIXTURE.read_text())["traceEvents"] if e.get("cat") == "kernel"]
