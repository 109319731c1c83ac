"""kda_witness: proof, from torch.profiler traces, of which KDA kernels ran and why others did not.

The chain wraps every stage call in a profiler range `kda::<stage>::<impl>[::<reason>]`
(`stage_range`); the witness profiles a callable (`profile`), attributes every CUDA kernel to the
innermost such range, and reports per-stage rows (`Results.table()`, `.rows()`). `expect` fails
unless the named kernels launched, quoting each fallback's recorded reason. A pytest plugin
(fixture `witness`, marker `@pytest.mark.witness(kernels=[...])`) and a CLI (`kda-witness`) sit
on top. The witness knows stage and kernel names only; it never imports a kernel module.

    import kda_witness as kw
    res = kw.profile(step, batch)        # step's return value: res.value
    print(res.table())                   # stage, impl, calls, kernels, ms, reason
    kw.expect(res)                       # the four CuTe kernels launched, or why not
"""

from .capture import profile, profiled, record
from .expect import DEFAULT_KERNELS, WitnessError, expect
from .ranges import CUTE_KERNELS, annotate, parse_stage_range, range_name, stage_range
from .results import Results

__all__ = [
    "CUTE_KERNELS",
    "DEFAULT_KERNELS",
    "Results",
    "WitnessError",
    "annotate",
    "expect",
    "parse_stage_range",
    "profile",
    "profiled",
    "range_name",
    "record",
    "stage_range",
]
