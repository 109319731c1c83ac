"""The witness knows only the kernel names an op registers: these tests register the chain's four
(as kda_chain does at import) and put back whatever was registered before."""

import kda_witness
import pytest

KERNELS = {"kda_cute_fwd": "fwd", "kda_cute_b1": "b1", "kda_cute_dhu": "dhu", "kda_cute_intra": "intra"}


@pytest.fixture(autouse=True)
def _registered_kernels():
    before = kda_witness.expected_kernels()
    kda_witness.register_kernels(KERNELS)
    yield
    kda_witness.register_kernels(before)
