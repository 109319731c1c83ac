"""The optional peers' entry points, shared by the benchmarks (none is a dependency).

cuDNN-frontend 1.32.0's Hopper KDA (`cudnn.linear_attention`; on the device machine
bench/gpu_suite.sh installs the kit's `.dev-p` wheels, ../shared/device/README.md): packed
[total_T, H, 128] tensors with int32 cu_seqlens, l2-normalized q / k, the fp32 natural-log gate and
fp32 beta after the sigmoid.
"""

from __future__ import annotations

import os
from pathlib import Path


def cudnn_kda():
    """cuDNN-frontend's `kimi_delta_attention`, its NVRTC pointed at the CUDA 13 headers the device
    kit carries ($KDA_PEER_INCLUDE), or None when the peer is not installed."""
    try:
        from cudnn.linear_attention.cake import compiler
        from cudnn.linear_attention.ops import kimi_delta_attention
    except ImportError:
        return None
    inc = Path(os.environ.get("KDA_PEER_INCLUDE", "/tmp/kda-peer/nvidia/cu13/include"))
    compiler.cuda_include_dirs = lambda: (inc, inc / "cccl")
    return kimi_delta_attention
