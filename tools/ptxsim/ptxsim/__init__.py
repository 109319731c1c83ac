"""ptxsim: a PTX interpreter that runs a kernel's sm_90a PTX on the CPU, thread by thread, so a
kernel's output can be checked against float64 without a GPU (CI, this machine kind).

    numerics   float32 / bf16 / fp16 / tf32 bit conversions (registers hold bit patterns)
    program    the parser: Program, InlineAsmProgram, named_barriers
    cta        CTA: one block's threads as generators, the base opcodes and warp collectives
    memory     host tensors in and out of the emulated global memory
    tma        TensorMap (a launcher's description of a tensor map), the 128-byte swizzle
    hopper     HopperCTA: TMA, mbarriers, elect, named barriers, wgmma; run_grid
    kda        the launch harnesses of kda_cute's kernels (imports kda_cute lazily)
    snapshot   a pytest plugin recording every compiled PTX (`-p ptxsim.snapshot`)

Only `kda` knows any kernel; the rest models the hardware. Each module's docstring says what it
models and what it does not.
"""

from .cta import CTA
from .hopper import HopperCTA, run_grid
from .memory import global_memory, readback
from .program import InlineAsmProgram, Program, named_barriers
from .tma import TensorMap, param_address, swizzle

__all__ = [
    "CTA",
    "HopperCTA",
    "InlineAsmProgram",
    "Program",
    "TensorMap",
    "global_memory",
    "named_barriers",
    "param_address",
    "readback",
    "run_grid",
    "swizzle",
]
