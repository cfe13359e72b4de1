"""Launch settings for row-wise kernels (one or a few rows per program), with an explicit ceiling."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kp_core import tuning

# Widest row a single-block kernel holds in registers; wider rows go to a looped kernel.
MAX_FUSED_COLS = 16384
# Chunk width of the looped kernels.
LOOP_BLOCK_COLS = 8192
# Columns the Triton index arithmetic can address in one row.
MAX_COLS = 2**31 - 1


@dataclass(frozen=True)
class RowConfig:
    block_cols: int  # columns per block (power of two)
    block_rows: int  # rows per program
    num_warps: int
    looped: bool  # row wider than the fused limit: loop over column chunks


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0), exact at any size (no float): blocks needed to cover a items."""
    return -(-a // b)


def row_config(op: str, n_cols: int, element_size: int) -> RowConfig:
    """Pick block shape and warps for a row-wise kernel.

    About 16 KiB of input per program keeps enough bytes in flight per SM to stream near copy bandwidth
    while staying clear of register spills. `kp_core.pinned("row_config", max_fused_cols=.., loop_block_cols=..)`
    moves the fused / looped threshold, so tests reach the looped kernels on small rows.
    """
    return _row_config(op, n_cols, element_size, tuning.generation())


@functools.lru_cache(maxsize=1024)  # called on every launch; the answer depends only on its arguments
def _row_config(op: str, n_cols: int, element_size: int, _generation: int) -> RowConfig:
    if n_cols < 1 or n_cols > MAX_COLS:
        raise ValueError(f"{op}: rows must have between 1 and {MAX_COLS} elements, got {n_cols}")
    limits = tuning.settings("row_config", max_fused_cols=MAX_FUSED_COLS, loop_block_cols=LOOP_BLOCK_COLS)
    if n_cols > limits["max_fused_cols"]:
        return RowConfig(limits["loop_block_cols"], 1, 32 if limits["loop_block_cols"] >= 4096 else 4, True)
    block_cols = next_power_of_2(n_cols)
    row_bytes = block_cols * element_size
    block_rows = max(1, min(64, 16384 // row_bytes))
    tile = block_cols * block_rows
    num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return RowConfig(block_cols, block_rows, num_warps, False)


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index` (persistent grids and split counts size by it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, n_rows: int, per_sm: int = 4) -> int:
    """Programs for a kernel that walks rows in slices: a few per SM (a small fixed count off-GPU)."""
    if device.type == "cuda":
        slots = sm_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    else:
        slots = 4  # the interpreter runs programs one after another; more buys nothing
    return max(1, min(slots, n_rows))
