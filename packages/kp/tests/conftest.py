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
