"""kda_witness: proof, from torch.profiler traces, of which KDA kernels ran and why others did not.

The chain wraps every stage call in a profiler range `kda::<stage>::<impl>[::<reason>]`
(`stage_range`); the witness profiles a callable (`profile`), attributes every CUDA kernel to the
innermost such range, and reports per-stage rows (`Results.table()`, `.rows()`). `expect` fails
unless the named kernels launched, quoting each fallback's recorded reason. A pytest plugin
(fixture `witness`, marker `@pytest.mark.witness(kernels=[...])`) and a CLI (`kda-witness`) sit
on top. The witness knows stage and kernel names only, and only those an op registers
(`register_kernels`: kda_chain does at import); it depends on torch alone.

    import kda_witness as kw
    res = kw.profile(step, batch)        # step's return value: res.value
    print(res.table())                   # stage, impl, calls, kernels, ms, reason
    kw.expect(res)                       # the registered kernels launched, or why not
"""

from .capture import profile, profiled, record
from .expect import WitnessError, expect
from .ranges import annotate, expected_kernels, parse_stage_range, range_name, register_kernels, stage_range
from .results import Results

__all__ = [
    "Results",
    "WitnessError",
    "annotate",
    "expect",
    "expected_kernels",
    "parse_stage_range",
    "profile",
    "profiled",
    "range_name",
    "record",
    "register_kernels",
    "stage_range",
]
