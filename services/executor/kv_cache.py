"""Preallocated paged KV cache, per-page slot visibility, and embedding slots.

Invariants:
- `layers[l]` is `[num_pages, 2, page_size, num_kv_heads, head_dim]` (K at index 0, V at 1), one tensor
  per layer so that writes never touch a shared base tensor (better for torch.compile).
- `page_visible[p, s]` is ANDed into every attention that reads slot `s` of page `p` (the new tokens'
  own slots included). It is reset to visible when the page is allocated and changed only by
  `mask_kv_page` (and copied along by `copy_slots`).
- Allocation is bookkeeping (`is_page_allocated`, `is_slot_allocated`): the scheduler owns the real
  tables; the executor keeps its own to reject unknown ids.
"""

from __future__ import annotations

import numpy as np
import torch


class KvCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_embed_slots: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_embed_slots = num_embed_slots
        shape = (num_pages, 2, page_size, num_kv_heads, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_visible = torch.ones((num_pages, page_size), dtype=torch.bool, device=device)
        self.embeds = torch.zeros(
            (num_embed_slots, hidden_size), dtype=dtype, device=device
        )  # [slots, hidden]
        self.embed_positions = torch.zeros(num_embed_slots, dtype=torch.long, device=device)
        self.is_page_allocated = np.zeros(num_pages, dtype=bool)
        self.is_slot_allocated = np.zeros(num_embed_slots, dtype=bool)

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        )

    @property
    def num_free_pages(self) -> int:
        return int(self.num_pages - self.is_page_allocated.sum())

    @property
    def num_free_slots(self) -> int:
        return int(self.num_embed_slots - self.is_slot_allocated.sum())

    def allocate_pages(self, page_ids: np.ndarray) -> None:
        self.is_page_allocated[page_ids] = True
        self.page_visible[torch.as_tensor(page_ids, device=self.page_visible.device)] = True

    def deallocate_pages(self, page_ids: np.ndarray) -> None:
        self.is_page_allocated[page_ids] = False

    def allocate_slots(self, slot_ids: np.ndarray) -> None:
        self.is_slot_allocated[slot_ids] = True

    def deallocate_slots(self, slot_ids: np.ndarray) -> None:
        self.is_slot_allocated[slot_ids] = False

    def copy_slots(self, src_page: int, dst_page: int, src_offset: int, dst_offset: int, length: int) -> None:
        """Copy K/V and visibility of `length` token slots from one page to another, every layer."""
        src = slice(src_offset, src_offset + length)
        dst = slice(dst_offset, dst_offset + length)
        for layer in self.layers:
            layer[dst_page, :, dst] = layer[src_page, :, src].clone()
        self.page_visible[dst_page, dst] = self.page_visible[src_page, src].clone()
