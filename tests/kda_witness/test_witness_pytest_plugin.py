"""The pytest plugin: the `witness` fixture, and the marker's skip and failure paths."""

import textwrap

import torch

pytest_plugins = ["pytester"]

TESTS = textwrap.dedent(
    """
    import pytest, torch
    from kda_witness import stage_range

    def test_fixture(witness):
        def f():
            with stage_range("fwd", "reference", "cute: no CUDA device"):
                return torch.ones(4).sum()
        res = witness(f)
        assert res.value == 4 and res.stages[0].reason == "cute: no CUDA device"
        with pytest.raises(AssertionError):
            witness.expect(res, ["kda_cute_fwd"])

    @pytest.mark.witness(kernels=["kda_cute_fwd"])
    def test_marked():
        with stage_range("fwd", "fla", "cute: kernel not built yet"):
            torch.ones(4).sum()
    """
)


def test_plugin_cpu(pytester):
    pytester.makepyfile(TESTS)
    res = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    if torch.cuda.is_available():
        res.assert_outcomes(passed=1, failed=1)
    else:
        res.assert_outcomes(passed=1, skipped=1)
        res.stdout.fnmatch_lines(["*no CUDA device*"])


def test_marker_failure_message(pytester):
    # Pretend a CUDA device exists so the marker runs; on CPU no kernel launches, so it must fail
    # and quote the stage's recorded reason.
    pytester.makeconftest("import kda_witness.pytest_plugin as p\np._has_cuda = lambda: True\n")
    pytester.makepyfile(TESTS)
    res = pytester.runpytest("-p", "no:cacheprovider")
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*kernels not launched: kda_cute_fwd (stage fwd)*",
                              "*fwd -> fla: cute: kernel not built yet*"])
