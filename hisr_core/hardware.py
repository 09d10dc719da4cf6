"""The machine at hand: its CPU's name, and its dense float32 matmul rate (the peak that MFU is
measured against, and the yardstick that scales wall-time estimates measured on another
machine)."""

from __future__ import annotations

import platform
import time
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_flops(threads: int, n: int = 1536, repeats: int = 20) -> float:
    """The machine's float32 matmul FLOP/s on ``threads`` threads (best of ``repeats`` n x n
    products); the torch thread count is left as it was."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * n ** 3 / best
