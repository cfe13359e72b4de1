import pytest
import torch

import kp_core


def test_check_tensor_names_op_argument_expected_and_got():
    with pytest.raises(TypeError, match=r"my_op: x must have dtype in \(float16, float32\), got int64"):
        kp_core.check_tensor("my_op", "x", torch.ones(2, dtype=torch.int64), dtypes=(torch.float16, torch.float32))
    with pytest.raises(TypeError, match="my_op: x must be a torch.Tensor, got list"):
        kp_core.check_tensor("my_op", "x", [1.0])
    with pytest.raises(ValueError, match=r"my_op: x must have 2 dimensions, got shape \(3,\)"):
        kp_core.check_tensor("my_op", "x", torch.ones(3), ndim=2)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        kp_core.check_tensor("my_op", "x", torch.ones(3), min_ndim=2)
    with pytest.raises(ValueError, match="must be on meta"):
        kp_core.check_tensor("my_op", "x", torch.ones(3), device=torch.device("meta"))
    t = torch.ones(2, 3)
    assert kp_core.check_tensor("my_op", "x", t, dtypes=kp_core.FLOAT_DTYPES, ndim=2) is t


def test_shape_dtype_device_and_size_checks():
    with pytest.raises(ValueError, match=r"op: w must have shape \(4,\), got \(3,\)"):
        kp_core.check_shape("op", "w", torch.ones(3), (4,))
    with pytest.raises(TypeError, match=r"w must have the dtype of x \(float32\), got float16"):
        kp_core.check_same_dtype("op", "w", torch.ones(1, dtype=torch.float16), torch.ones(1), "x")
    with pytest.raises(ValueError, match="w must be on the same device as x"):
        kp_core.check_same_device("op", x=torch.ones(1), w=torch.ones(1, device="meta"))
    kp_core.check_same_device("op", x=torch.ones(1), w=None)
    with pytest.raises(ValueError, match="more than the kernel's limit"):
        kp_core.check_index_fits("op", "x", 2**31)


def test_row_config_blocks_and_ceiling():
    cfg = kp_core.row_config("op", 4097, 2)
    assert cfg.block_cols == 8192 and not cfg.looped and cfg.block_rows >= 1
    narrow = kp_core.row_config("op", 33, 4)
    assert narrow.block_cols == 64 and narrow.block_rows > 1  # several short rows per program
    wide = kp_core.row_config("op", kp_core.MAX_FUSED_COLS + 1, 2)
    assert wide.looped
    for bad in (0, 2**31):
        with pytest.raises(ValueError, match="op: rows must have between 1 and"):
            kp_core.row_config("op", bad, 2)
    assert [kp_core.next_power_of_2(n) for n in (1, 2, 3, 1024, 1025)] == [1, 2, 4, 1024, 2048]
    assert kp_core.persistent_programs(torch.device("cpu"), 3) == 3
