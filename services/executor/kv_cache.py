"""Preallocated paged KV cache, per-page slot visibility, and embedding slots.

Invariants:
- `layers[l]` is `[num_pages, 2, page_size, num_kv_heads, head_dim]` (K at index 0, V at 1), one tensor
  per layer so that writes never touch a shared base tensor (better for torch.compile). Its element type is
  `kv_dtype`: the model's dtype, or float16 on a float32 CPU engine (`EngineConfig.kv_cache_dtype`, half the
  bytes per page); the swap area has the same, the embedding slots keep the dtype.
- `page_visible[p, s]` is ANDed into every attention that reads slot `s` of page `p` (the new tokens'
  own slots included). It is reset to visible when the page is allocated and changed only by
  `mask_kv_page` (and copied along by `copy_slots`).
- Allocation zeroes what it hands out (a page's K/V in every layer, a slot's embedding and position),
  so a page or slot never shows a previous owner's data: attention over slots the new owner never
  wrote reads the same zeros as a never-used cache. Shared pages (exports/imports) are never
  allocated twice (the scheduler retains them), so they keep their content. Zeroing is one
  `index_fill_` per layer (no host sync on CUDA): ~0.2-0.6 ms per 720 KiB page of SmolLM2-135M
  (float32, page_size 16) on a busy 2-core CPU, under 1% of a decode step that needs a new page.
- On a CPU each layer's K/V is an anonymous mapping (`zeroed`): memory is taken as pages are first
  written, so an executor holds what its pages in use need, not the whole cache it was sized for.
- `scratch_pages` extra pages sit past `num_pages` (ids no command can name): the static decoder's
  padding rows write and read there (`decode_graphs.py`).
- `swap_layers` / `swap_visible` are the host swap area (`num_swap_slots` slots, each one page of every
  layer and its visibility row): `swap_out` copies pages there and frees them, `swap_in` allocates pages
  and copies them back, bit for bit, so a preempted instance resumes on other physical pages with exactly
  the K/V it had. The scheduler owns the slots (which are in use); the cache only checks ids. The area is
  `torch.empty` (pinned on CUDA): a slot is always written before it is read, and untouched host memory
  costs nothing on CPU.
- The executor keeps its own allocation flags (`is_page_allocated`, `is_slot_allocated`) to reject
  unknown ids; the scheduler owns the real tables. `free_all` (the executor's Reset RPC) clears them
  when the scheduler reconnects with empty tables, so the two never disagree.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from l4m.executor.host_memory import anonymous_bytes


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU an anonymous mapping, which the kernel backs with zeroed memory page by
    page as it is first written: the cache holds resident memory for the pages in use, not for all it
    could hold (`torch.zeros` writes every byte: an executor whose cache was sized at 4.6 GB held 4.6 GB
    from its start). Decode steps read it as fast (batch 64, interleaved; with MADV_HUGEPAGE, no faster).
    The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return anonymous_bytes(nbytes).view(dtype).view(shape)


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
        scratch_pages: int = 0,
        num_swap_slots: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """K/V (pages and swap slots) of `kv_dtype` (default `dtype`), embeddings of `dtype`."""
        kv_dtype = kv_dtype or dtype
        self.kv_dtype = kv_dtype
        self.num_pages = num_pages
        self.num_scratch_pages = scratch_pages
        self.page_size = page_size
        self.num_embed_slots = num_embed_slots
        shape = (num_pages + scratch_pages, 2, page_size, num_kv_heads, head_dim)
        self.layers = [zeroed(shape, kv_dtype, device) for _ in range(num_layers)]
        self.page_visible = torch.ones((num_pages + scratch_pages, page_size), dtype=torch.bool, device=device)
        self.embeds = torch.zeros(
            (num_embed_slots, hidden_size), dtype=dtype, device=device
        )  # [slots, hidden]
        self.embed_positions = torch.zeros(num_embed_slots, dtype=torch.long, device=device)
        self.num_swap_slots = num_swap_slots
        pin = device.type == "cuda"
        swap_shape = (num_swap_slots, 2, page_size, num_kv_heads, head_dim)
        self.swap_layers = [torch.empty(swap_shape, dtype=kv_dtype, pin_memory=pin) for _ in range(num_layers)]
        self.swap_visible = torch.empty((num_swap_slots, page_size), dtype=torch.bool, pin_memory=pin)
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

    def _device_index(self, ids: np.ndarray) -> torch.Tensor:
        """`ids` as a long tensor on the cache's device; on CUDA copied from pinned memory without
        waiting for the device."""
        index = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        device = self.page_visible.device
        if device.type == "cuda":
            return index.pin_memory().to(device, non_blocking=True)
        return index

    def allocate_pages(self, page_ids: np.ndarray) -> None:
        """Mark pages allocated, every slot visible, K/V zero in every layer."""
        self.is_page_allocated[page_ids] = True
        if len(page_ids) == 0:
            return
        index = self._device_index(page_ids)
        self.page_visible.index_fill_(0, index, True)
        for layer in self.layers:  # [num_pages, 2, page_size, kv_heads, head_dim]
            layer.index_fill_(0, index, 0)

    def deallocate_pages(self, page_ids: np.ndarray) -> None:
        self.is_page_allocated[page_ids] = False

    def allocate_slots(self, slot_ids: np.ndarray) -> None:
        """Mark slots allocated with a zero embedding at position 0."""
        self.is_slot_allocated[slot_ids] = True
        if len(slot_ids) == 0:
            return
        index = self._device_index(slot_ids)
        self.embeds.index_fill_(0, index, 0)
        self.embed_positions.index_fill_(0, index, 0)

    def deallocate_slots(self, slot_ids: np.ndarray) -> None:
        self.is_slot_allocated[slot_ids] = False

    def free_all(self) -> tuple[int, int]:
        """Free every page and slot, zeroing what was held (as allocation would); returns how many
        pages and slots were allocated."""
        pages = np.flatnonzero(self.is_page_allocated)
        slots = np.flatnonzero(self.is_slot_allocated)
        self.allocate_pages(pages)
        self.allocate_slots(slots)
        self.is_page_allocated[:] = False
        self.is_slot_allocated[:] = False
        return len(pages), len(slots)

    def copy_slots(self, src_page: int, dst_page: int, src_offset: int, dst_offset: int, length: int) -> None:
        """Copy K/V and visibility of `length` token slots from one page to another, every layer."""
        src = slice(src_offset, src_offset + length)
        dst = slice(dst_offset, dst_offset + length)
        for layer in self.layers:
            layer[dst_page, :, dst] = layer[src_page, :, src].clone()
        self.page_visible[dst_page, dst] = self.page_visible[src_page, src].clone()

    def swap_out(self, page_ids: np.ndarray, slot_ids: np.ndarray) -> None:
        """Copy pages (every layer's K/V and their visibility) into host swap slots, then free the pages."""
        if len(page_ids) == 0:
            return
        pages = self._device_index(page_ids)
        slots = torch.from_numpy(np.ascontiguousarray(slot_ids, dtype=np.int64))
        for layer, swap in zip(self.layers, self.swap_layers, strict=True):  # [pages, 2, page_size, kv_heads, head_dim]
            swap.index_copy_(0, slots, layer.index_select(0, pages).to("cpu"))
        self.swap_visible.index_copy_(0, slots, self.page_visible.index_select(0, pages).to("cpu"))
        self.is_page_allocated[page_ids] = False

    def swap_in(self, page_ids: np.ndarray, slot_ids: np.ndarray) -> None:
        """Allocate pages and fill them from host swap slots (as `swap_out` left them)."""
        self.is_page_allocated[page_ids] = True
        if len(page_ids) == 0:
            return
        pages = self._device_index(page_ids)
        slots = torch.from_numpy(np.ascontiguousarray(slot_ids, dtype=np.int64))
        device = self.page_visible.device
        for layer, swap in zip(self.layers, self.swap_layers, strict=True):
            layer.index_copy_(0, pages, swap.index_select(0, slots).to(device, non_blocking=True))
        self.page_visible.index_copy_(0, pages, self.swap_visible.index_select(0, slots).to(device, non_blocking=True))
