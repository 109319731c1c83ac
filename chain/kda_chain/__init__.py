"""kda_chain: the drop-in `chunk_kda` composed from kda_cute's CuTe stages and fla's remaining ones.

    from kda_chain import chunk_kda      # instead of: from fla.ops.kda import chunk_kda

Stage order and contracts: forward.py, backward.py, ARCHITECTURE.md. Which implementation each
stage took, and why: `dispatch_log()`, or the witness (`kda-witness`) from a profiler trace.
"""

from .api import chunk_kda, is_supported, validate, warmup
from .stages import CUTE_STAGES, STAGES, dispatch_log, reset_dispatch_log

__all__ = ["chunk_kda", "is_supported", "validate", "warmup", "dispatch_log", "reset_dispatch_log",
           "STAGES", "CUTE_STAGES"]
