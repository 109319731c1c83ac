"""The CLI's CPU path end to end at a tiny shape: table, accuracy, --require-cute, --trace."""

import pytest
import torch
from kda_chain.witness import CUTE_STAGES, main
from kda_witness import Results


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_cli_cpu(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    argv = ["--B", "1", "--T", "80", "--H", "1", "--HV", "2", "--K", "16", "--V", "16", "--reps", "1",
            "--require-cute", "--trace", str(trace)]
    status = main(argv)
    out = capsys.readouterr().out
    assert status == 1, out  # on CPU the CuTe stages cannot run: --require-cute fails
    assert "CPU only" in out and "NO CUDA kernels were recorded" in out
    assert "--require-cute: FAIL" in out and "stage intra -> reference: cute: " in out
    assert "FAIL for" not in out  # accuracy held
    for name in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"):
        assert f"  {name} " in out, name
    res = Results.from_chrome_trace(trace)
    assert set(CUTE_STAGES) <= {r.stage for r in res.stages}


def test_cli_flags_off(capsys):
    argv = ["--B", "1", "--T", "64", "--H", "1", "--HV", "1", "--K", "16", "--V", "16", "--reps", "1",
            "--no-gate-in-kernel", "--no-l2norm", "--no-initial-state", "--no-final-state"]
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    assert main(argv) == 0
    cap = capsys.readouterr()
    out = cap.out
    assert "  dA_log " not in out and "  dh0 " not in out and "  ht " not in out and "  dg " in out
    # on CPU nothing compiles: the progress line must not say it does
    assert "nothing compiles on CPU" in cap.err and "compiles the CuTe kernels" not in cap.err


def test_cli_checks_the_first_sequence_at_large_shapes(monkeypatch, capsys):
    import kda_chain.witness as cli

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    monkeypatch.setattr(cli, "CHECK_FULL_LIMIT", 1)  # every shape counts as large
    argv = ["--B", "2", "--T", "64", "--H", "1", "--HV", "1", "--K", "16", "--V", "16", "--reps", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "the first sequence (B=1" in out and "FAIL" not in out
    assert main([*argv, "--check-full"]) == 0
    assert "the whole batch" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_cli_packed(monkeypatch, capsys):
    """--packed: one row of N sequences with cu_seqlens, checked against the per-sequence float64
    chain; --require-cute names the packed rows' gather (on CPU the CuTe prep cannot run); at a
    large shape only the first sequence is checked, as a packed call of its own."""
    import kda_chain.witness as cli

    argv = ["--B", "2", "--T", "80", "--H", "1", "--HV", "2", "--K", "16", "--V", "16", "--reps", "1",
            "--packed", "3", "--require-cute"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "packed as 3 sequences" in out and "FAIL for" not in out
    assert "varlen_io -> gather: fwd_prep: cute: " in out
    monkeypatch.setattr(cli, "CHECK_FULL_LIMIT", 1)
    assert main(argv[:-1]) == 0
    assert "the first sequence" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--B", "1", "--T", "4", "--packed", "5"])
