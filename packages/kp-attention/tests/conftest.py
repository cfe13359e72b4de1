import os

# Without a GPU the kernels run under Triton's interpreter, which must be on before kp_attention imports.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import kp_core  # noqa: E402


@pytest.fixture(autouse=True)
def kp_kernels():
    """The tests check kp's kernels: backend="auto", the default, must not hand a call to torch's SDPA (the
    backend tests lift this pin)."""
    with kp_core.pinned("attention_backend", backend="kp"):
        yield
