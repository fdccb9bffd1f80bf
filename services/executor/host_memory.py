"""Host memory the executor maps itself rather than takes from torch's allocator.

An anonymous private mapping reads as zeros and is backed by the kernel page by page as it is first
written, and it can be advised for transparent huge pages as a whole. Torch's allocator gives neither
guarantee: `torch.zeros` writes every byte, and a freed block may come back with old contents.
"""

from __future__ import annotations

import mmap

import torch


def anonymous_bytes(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` over a fresh anonymous mapping, all zeros and not yet resident; with
    `huge_pages`, advised MADV_HUGEPAGE (where the kernel offers it). The tensor, and every view of it,
    keeps the mapping alive."""
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(area, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(area, dtype=torch.uint8)
