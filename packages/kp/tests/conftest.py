import os

import pytest
import torch

# Off-GPU the kernels run under Triton's interpreter, which must be on before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    """Each test its own decision cache: never the user's ~/.cache."""
    monkeypatch.setenv("KP_CACHE_DIR", str(tmp_path / "kp-cache"))


@pytest.fixture(autouse=True, scope="session")
def _interpreter_matmul_tiles():
    """Under the interpreter each program is a Python-level pass: the float8 matmul's own interpreter tile
    (16 x 32 x 32, small so the specs' small shapes cross tile and scale-block edges) took 384 s of the 620 s a
    2-layer Llama's fusion test spent (cProfile). These tests check kp's decisions and fusions, not the matmul's
    tiling (conformance/specs/test_scaled_mm.py does), so they run it on 64 x 64 x 64 tiles, and the float8
    backward's transpose on 64 x 64 tiles (16 x 16 under the interpreter: test_quantize.py crosses them). A GPU
    keeps its own."""
    if DEVICE == "cuda":
        yield
        return
    import kp_core

    with kp_core.pinned("_scaled_mm", block_m=64, block_n=64, block_k=64), kp_core.pinned("_transpose", block=64):
        yield
