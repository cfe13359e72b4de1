"""Launch settings for row-wise kernels (one or a few rows per program), with an explicit ceiling."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kp_core import tuning

MAX_FUSED_COLS = 16384
"""Widest row (elements) a single-block row-wise kernel holds in registers; wider rows go to a looped kernel."""
# Chunk width of the looped kernels.
LOOP_BLOCK_COLS = 8192
# Columns the Triton index arithmetic can address in one row.
MAX_COLS = 2**31 - 1


@dataclass(frozen=True)
class RowConfig:
    """The launch settings `row_config` picks for a row-wise kernel.

    Attributes:
        block_cols: columns per block (a power of two).
        block_rows: rows per program.
        num_warps: warps per program.
        looped: whether the row is wider than the fused limit (MAX_FUSED_COLS), so the kernel loops over chunks
            of block_cols columns.

    Examples:
        >>> import kp_core
        >>> kp_core.RowConfig(block_cols=1024, block_rows=8, num_warps=4, looped=False).block_rows
        8
    """

    block_cols: int  # columns per block (power of two)
    block_rows: int  # rows per program
    num_warps: int
    looped: bool  # row wider than the fused limit: loop over column chunks


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes.

    Examples:
        >>> import kp_core
        >>> kp_core.next_power_of_2(300), kp_core.next_power_of_2(512)
        (512, 512)
    """
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0), exact at any size (no float): blocks needed to cover a items.

    Examples:
        >>> import kp_core
        >>> kp_core.cdiv(10, 4), kp_core.cdiv(2**62 + 1, 2)
        (3, 2305843009213693953)
    """
    return -(-a // b)


def row_config(op: str, n_cols: int, element_size: int) -> RowConfig:
    """Pick block shape and warps for a row-wise kernel.

    About 16 KiB of input per program keeps enough bytes in flight per SM to stream near copy bandwidth
    while staying clear of register spills. `kp_core.pinned("row_config", max_fused_cols=.., loop_block_cols=..)`
    moves the fused / looped threshold, so tests reach the looped kernels on small rows.

    Args:
        op: the op's name, for the error message (rows of 0 or more than 2**31 - 1 elements are a ValueError).
        n_cols: the row's length in elements.
        element_size: bytes per element of the input (2 for float16 / bfloat16, 4 for float32).

    Examples:
        >>> import kp_core
        >>> kp_core.row_config("my_op", 4096, 2)
        RowConfig(block_cols=4096, block_rows=2, num_warps=8, looped=False)
        >>> kp_core.row_config("my_op", 100_000, 2).looped
        True
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
    """Streaming multiprocessors of CUDA device `index` (persistent grids and split counts size by it). Cached;
    a CUDA device is needed.

    Examples:
        >>> import kp_core
        >>> kp_core.sm_count(0)  # on an H100 SXM (needs a GPU)
        132
    """
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, n_rows: int, per_sm: int = 4) -> int:
    """Programs for a kernel that walks rows in slices: a few per SM (a small fixed count off-GPU).

    `per_sm` programs per streaming multiprocessor on a CUDA device, 4 elsewhere; never more than `n_rows`, at
    least 1.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> kp_core.persistent_programs(torch.device("cpu"), n_rows=100)
        4
    """
    if device.type == "cuda":
        slots = sm_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    else:
        slots = 4  # the interpreter runs programs one after another; more buys nothing
    return max(1, min(slots, n_rows))
