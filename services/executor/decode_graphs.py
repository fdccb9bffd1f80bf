"""Decode steps without the launch wall: batches of single-token items through fixed-shape buffers, one
CUDA graph per shape bucket.

A decode step of the per-op path (`LlamaModel.forward`) is ~25 small kernels per layer launched from
Python, plus a per-batch attention plan; on a GPU the CPU launching them is the whole step. Here:

- the batch is padded to a **batch bucket** (1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to `max_batch`) and
  every item's page table to a **page bucket** (a power of two, up to the model's context in pages);
- per step the host writes one small int32 block (positions, where each new K/V goes, context lengths,
  page tables) and the hidden states into the bucket's static buffers, then replays its graph: nine
  kernels per layer (`decode_ops`: fused residual add + RMSNorm, fused RoPE + KV write, paged decode
  attention reading the page table and the page visibility itself, SiLU-and-multiply, and the four
  matmuls);
- padding rows write their K/V to a **scratch page** past the cache's last page (`KvCache(scratch_pages=1)`)
  that no command can name, and attend only to it, so they never touch an item's pages.

Masks stay exact: a slot counts when it is before the item's length, its page's visibility allows it,
the item's BRLE row (if it sent one) allows it, and it lies in the model's sliding window (if any); an item that sees nothing gets a zero attention
output, as on the per-op path. A bucket's graph is captured the first time a batch needs it (one
eager warm-up run, which compiles the Triton kernels, then the capture), or, with `capture_all`, every
bucket's at once before the engine takes traffic (the executor service does that); all graphs share one
memory pool, which is safe because steps run one at a time and the output is copied out before the next.

**Continuation on the device** (`StaticDecoder.continue_greedy`): items that decode on greedily feed each
sampled token back without the host. A second graph per bucket holds a whole step: embedding of the
token buffer, the layers, the LM head, argmax and its logprob, recording the token, the stop check
(a per-row table over the vocabulary), and advancing each still-active row's position, length and
write slot (a stopped or finished row writes the scratch page from then on). The host replays it once
per step, looks at "is any row still going" every `SYNC_EVERY` steps, and copies the tokens back once.

Off CUDA (or with `graphs=False`) the same static step runs eagerly, with `decode_ops.TorchOps` on the
CPU: that is how the tests check the padding and the buffers against the per-op path without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from l4m.executor.attention import ItemLayout
from l4m.executor.kv_cache import KvCache
from l4m.executor.model import LlamaModel
from l4m.wire.brle import decode_rows

log = logging.getLogger("l4m.executor")

SYNC_EVERY = 4  # continuation steps between two looks at "is any row still going" (one host sync each)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The padded batch sizes up to `max_batch` (which is always one of them)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)


def page_buckets(max_pages: int) -> tuple[int, ...]:
    """Powers of two from 1, the last one the first >= `max_pages`."""
    buckets = [1]
    while buckets[-1] < max_pages:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def capture_keys(batch_buckets_: Sequence[int], page_buckets_: Sequence[int], max_pages: int) -> list[tuple[int, int]]:
    """The (batch, pages) buckets `StaticDecoder.capture_all` captures: every batch bucket with every page
    bucket up to the one that holds `max_pages` (an item never has more pages than the cache), the
    small page buckets first (the contexts most batches have)."""
    if max_pages < 1:
        raise ValueError(f"max_pages must be >= 1, got {max_pages}")
    last = bucket_for(max_pages, page_buckets_) or page_buckets_[-1]
    return [(batch, pages) for pages in page_buckets_ if pages <= last for batch in batch_buckets_]


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n, or None when n is past the last."""
    for b in buckets:
        if b >= n:
            return b
    return None


class _Graphed:
    """A fixed-shape `body` that runs eagerly until `capture` records it as a CUDA graph, then replays."""

    graph: torch.cuda.CUDAGraph | None = None
    device: torch.device

    def body(self) -> None:
        raise NotImplementedError

    def prepare_capture(self) -> None:
        """Leave the buffers so that the warm-up run writes only the scratch page."""
        raise NotImplementedError

    def capture(self, pool: object) -> None:
        self.prepare_capture()
        self.body()  # warm-up: compiles the kernels, sizes cuBLAS's workspace
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.body()
        self.graph = graph

    def run(self) -> None:
        if self.graph is None:
            self.body()
        else:
            self.graph.replay()


class _Step(_Graphed):
    """The static buffers of one (batch bucket, page bucket) and, on CUDA, its graph."""

    def __init__(self, decoder: StaticDecoder, batch: int, pages: int) -> None:
        self.batch, self.pages = batch, pages
        model, cache, device = decoder.model, decoder.cache, decoder.device
        cfg = model.config
        self.decoder = decoder
        self.device = device
        # One int32 block, copied in with one transfer: positions, write pages, write offsets,
        # context lengths (each [batch]), then the page table [batch, pages].
        self.host = torch.empty(4 * batch + batch * pages, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.meta = torch.empty_like(self.host, device=device)
        self.positions, self.write_page, self.write_offset, self.ctx_len = (
            self.meta[i * batch : (i + 1) * batch] for i in range(4)
        )
        self.page_table = self.meta[4 * batch :].view(batch, pages)
        self.row_visible = torch.ones((batch, pages * cache.page_size), dtype=torch.uint8, device=device)
        self.row_mask_custom = False
        # A sliding window: each step ANDs "slot >= ctx_len - window" into the rows' visibility, on the
        # device, so the continuation loop's advancing ctx_len moves the window with it.
        self.window = cfg.sliding_window
        self.slots = torch.arange(pages * cache.page_size, device=device)[None, :] if self.window else None
        self.visible = torch.ones_like(self.row_visible) if self.window else self.row_visible
        self.hidden = torch.zeros((batch, cfg.hidden_size), dtype=torch.float32, device=device)
        dtype = model.dtype
        self.x = torch.zeros((batch, cfg.hidden_size), dtype=dtype, device=device)
        self.out = torch.zeros((batch, cfg.hidden_size), dtype=dtype, device=device)
        self.q = torch.zeros((batch, cfg.num_heads, cfg.head_dim), dtype=dtype, device=device)
        self.attn = torch.zeros((batch, cfg.num_heads * cfg.head_dim), dtype=dtype, device=device)
        self.act = torch.zeros((batch, cfg.intermediate_size), dtype=dtype, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.loop: _Loop | None = None

    def prepare_capture(self) -> None:
        """Every row a padding row: what the warm-up and the capture run on (they touch only scratch)."""
        self._fill([], np.zeros(0, dtype=np.int64))
        self.meta.copy_(self.host)

    def _fill(self, layouts: Sequence[ItemLayout], positions: np.ndarray) -> None:
        b, n = self.batch, len(layouts)
        page_size, scratch = self.decoder.cache.page_size, self.decoder.scratch_page
        block = self.host_np
        pos, wpage, woff, ctx = (block[i * b : (i + 1) * b] for i in range(4))
        table = block[4 * b :].reshape(b, self.pages)
        table.fill(scratch)
        pos[n:] = 0
        wpage[n:] = scratch
        woff[n:] = 0
        ctx[n:] = 1
        for r, it in enumerate(layouts):
            table[r, : len(it.page_ids)] = it.page_ids
            slot = it.num_ctx
            wpage[r] = it.page_ids[slot // page_size]
            woff[r] = slot % page_size
            ctx[r] = slot + 1
        pos[:n] = positions

    def load(self, layouts: Sequence[ItemLayout], hidden: torch.Tensor | None, positions: torch.Tensor) -> None:
        """The step's inputs: the int32 block, the rows' hidden states (None: the loop embeds its own
        tokens), the BRLE rows."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's transfer has left the pinned block
        self._fill(layouts, positions.cpu().numpy())
        self.meta.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if hidden is not None:
            self.hidden[: hidden.shape[0]].copy_(hidden)
        custom = [r for r, it in enumerate(layouts) if it.mask_rows]
        if custom or self.row_mask_custom:
            self.row_visible.fill_(1)
            if custom:
                decoded = decode_rows([layouts[r].mask_rows[0] for r in custom], self.row_visible.shape[1])
                self.row_visible[custom] = torch.from_numpy(decoded.astype(np.uint8)).to(self.row_visible.device)
            self.row_mask_custom = bool(custom)

    def body(self) -> None:
        """The step itself: every op writes into this bucket's buffers, so a graph can replay it."""
        model, ops, cache = self.decoder.model, self.decoder.ops, self.decoder.cache
        cfg = model.config
        eps = cfg.rms_norm_eps
        layers = model.layers
        ops.add_rms_norm(self.hidden, None, layers[0].input_norm, eps, self.x)
        if self.window:
            in_window = self.slots >= (self.ctx_len - self.window)[:, None]
            torch.mul(self.row_visible, in_window, out=self.visible)
        for i, (layer, kv) in enumerate(zip(layers, cache.layers, strict=True)):
            qkv = layer.qkv(self.x)
            ops.rope_write_kv(
                qkv, self.positions, model.rope_cos, model.rope_sin, kv, self.write_page, self.write_offset, self.q
            )
            ops.decode_attention(
                self.q, kv, self.page_table, self.ctx_len, cache.page_visible, self.visible, self.attn
            )
            ops.add_rms_norm(self.hidden, layer.o(self.attn), layer.post_norm, eps, self.x)
            ops.silu_mul(layer.gate_up(self.x), self.act)
            last = i + 1 == len(layers)
            norm = model.final_norm if last else layers[i + 1].input_norm
            ops.add_rms_norm(self.hidden, layer.down(self.act), norm, eps, self.out if last else self.x)


class _Loop(_Graphed):
    """The device-side continuation state of one `_Step` and, on CUDA, its graph (a whole greedy step)."""

    def __init__(self, step: _Step, max_steps: int) -> None:
        batch, device = step.batch, step.decoder.device
        vocab = step.decoder.model.config.vocab_size
        self.step = step
        self.device = device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.steps_left = torch.zeros(batch, dtype=torch.int32, device=device)
        self.num_out = torch.zeros(batch, dtype=torch.int32, device=device)
        self.stop_table = torch.zeros((batch, vocab), dtype=torch.bool, device=device)
        self.out_tokens = torch.zeros((max_steps + 1, batch), dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros((max_steps + 1, batch), dtype=torch.float32, device=device)
        self.index = torch.zeros(1, dtype=torch.long, device=device)

    def body(self) -> None:
        step, model = self.step, self.step.decoder.model
        page_size, scratch = step.decoder.cache.page_size, step.decoder.scratch_page
        step.hidden.copy_(model.embed_tokens(self.tokens))
        step.body()
        logits = model.logits(step.out)  # [B, V] float32
        tokens = logits.argmax(-1)
        logprobs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
        self.out_tokens.index_copy_(0, self.index, tokens[None])
        self.out_logprobs.index_copy_(0, self.index, logprobs[None])
        self.index.add_(1)
        was_active = self.active
        self.num_out.add_(was_active.int())
        self.steps_left.sub_(was_active.int())
        stopped = self.stop_table.gather(1, tokens[:, None])[:, 0]
        self.active.copy_(was_active & ~stopped & (self.steps_left > 0))
        self.tokens.copy_(tokens)
        # The next step of a row still going: one position and one slot on; the others write scratch.
        going = self.active.int()
        step.positions.add_(going)
        step.ctx_len.add_(going)
        slot = (step.ctx_len - 1).long()
        page = step.page_table.gather(1, (slot // page_size)[:, None])[:, 0]
        step.write_page.copy_(torch.where(self.active, page, torch.full_like(page, scratch)))
        step.write_offset.copy_(torch.where(self.active, slot % page_size, torch.zeros_like(slot)).int())

    def prepare_capture(self) -> None:
        self.step.prepare_capture()
        self.active.zero_()  # every row inactive: the warm-up writes only the scratch page


class StaticDecoder:
    """Runs batches of single-token items through `_Step`s; see the module docstring."""

    def __init__(
        self, model: LlamaModel, cache: KvCache, ops: type, max_batch: int = 64, graphs: bool = True
    ) -> None:
        if cache.num_scratch_pages < 1:
            raise ValueError("the static decoder needs a KV cache with a scratch page")
        self.model, self.cache, self.ops = model, cache, ops
        self.device = cache.page_visible.device
        self.scratch_page = cache.num_pages  # the first page past those commands may name
        self.graphs = graphs and self.device.type == "cuda"
        self.batch_buckets = batch_buckets(max_batch)
        self.page_buckets = page_buckets(-(-model.config.max_context // cache.page_size))
        self._steps: dict[tuple[int, int], _Step] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.capture_seconds = 0.0

    @property
    def num_graphs(self) -> int:
        return sum(
            (step.graph is not None) + (step.loop is not None and step.loop.graph is not None)
            for step in self._steps.values()
        )

    def decode_graphs(self, batch: int) -> dict[int, torch.cuda.CUDAGraph]:
        """The captured decode graphs of `batch`'s bucket, by page bucket (what a benchmark replays)."""
        bucket = bucket_for(batch, self.batch_buckets)
        return {pages: step.graph for (b, pages), step in sorted(self._steps.items())
                if b == bucket and step.graph is not None}

    def _step(self, key: tuple[int, int]) -> _Step:
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = _Step(self, *key)
        return step

    def _loop(self, key: tuple[int, int], step: _Step, max_steps: int) -> _Loop:
        """`step`'s continuation loop, made (and on CUDA captured) the first time it is needed."""
        if step.loop is None:
            step.loop = _Loop(step, max_steps)
            if self.graphs:
                self._timed_capture("continuation", key, step.loop.capture)
        return step.loop

    def _timed_capture(self, what: str, key: tuple[int, int], capture) -> None:
        started = time.perf_counter()
        capture(self._pool)
        took = time.perf_counter() - started
        self.capture_seconds += took
        log.info("captured the %s graph of batch %d x %d pages in %.2f s", what, *key, took)

    def capture_all(self, max_steps: int) -> tuple[int, float]:
        """Capture the decode graph and the continuation graph (`max_steps` steps at most) of every
        bucket an item of this cache can fall in (`capture_keys`) that has none yet; returns how many
        graphs were captured and the seconds it took. Nothing to do off CUDA (the steps run eagerly)."""
        if not self.graphs:
            return 0, 0.0
        before, seconds_before = self.num_graphs, self.capture_seconds
        for key in capture_keys(self.batch_buckets, self.page_buckets, self.cache.num_pages):
            step = self._step(key)
            if step.graph is None:
                self._timed_capture("decode", key, step.capture)
            self._loop(key, step, max_steps)
        return self.num_graphs - before, self.capture_seconds - seconds_before

    def bucket(self, layouts: Sequence[ItemLayout]) -> tuple[int, int] | None:
        """The (batch, pages) bucket of a decode batch, or None when it is bigger than every bucket."""
        batch = bucket_for(len(layouts), self.batch_buckets)
        pages = bucket_for(max(len(it.page_ids) for it in layouts), self.page_buckets)
        if batch is None or pages is None:
            return None
        return batch, pages

    def run(
        self,
        layouts: Sequence[ItemLayout],
        hidden: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor,
    ) -> torch.Tensor:
        """`LlamaModel.forward` for single-token `layouts` (all num_new == 1) in a bucket: the final-normed
        hidden states of `output_rows` `[M, hidden]`, K/V written into the cache."""
        key = self.bucket(layouts)
        if key is None:
            raise ValueError(f"a decode batch of {len(layouts)} items is bigger than every bucket")
        step = self._step(key)
        if self.graphs and step.graph is None:
            self._timed_capture("decode", key, step.capture)
        step.load(layouts, hidden, positions)
        step.run()
        return step.out.index_select(0, output_rows)

    def continue_greedy(
        self,
        layouts: Sequence[ItemLayout],
        tokens: Sequence[int],
        positions: Sequence[int],
        num_steps: Sequence[int],
        stop_token_ids: Sequence[frozenset[int]],
        max_steps: int,
    ) -> list[list[tuple[int, float]]]:
        """Greedy continuation of items on the device: item i feeds `tokens[i]` at `positions[i]` into
        the slot its layout's `num_ctx` names (its pages hold every later step too), then feeds back what
        it samples, for `num_steps[i]` steps or until it samples one of `stop_token_ids[i]`. Returns each
        item's (token, logprob) per step run, as the host loop (`continuation.run_continuations`) would."""
        key = self.bucket(layouts)
        if key is None:
            raise ValueError(f"a decode batch of {len(layouts)} items is bigger than every bucket")
        step = self._step(key)
        loop = self._loop(key, step, max_steps)
        n = len(layouts)
        step.load(layouts, None, torch.tensor(list(positions)))
        loop.tokens[:n].copy_(torch.tensor(list(tokens)))
        active = torch.zeros(step.batch, dtype=torch.bool)
        active[:n] = torch.tensor([k > 0 for k in num_steps])
        loop.active.copy_(active)
        left = torch.zeros(step.batch, dtype=torch.int32)
        left[:n] = torch.tensor(list(num_steps), dtype=torch.int32)
        loop.steps_left.copy_(left)
        loop.num_out.zero_()
        loop.index.zero_()
        loop.stop_table.zero_()
        rows = [r for r, stops in enumerate(stop_token_ids) for _ in stops]
        if rows:
            cols = [t for stops in stop_token_ids for t in stops]
            loop.stop_table[torch.tensor(rows), torch.tensor(cols)] = True
        ran = 0
        while ran < max(num_steps, default=0):
            loop.run()
            ran += 1
            if ran % SYNC_EVERY == 0 and not bool(loop.active.any()):
                break
        counts = loop.num_out[:n].tolist()
        got_tokens = loop.out_tokens[:ran, :n].T.tolist()
        got_logprobs = loop.out_logprobs[:ran, :n].T.tolist()
        return [list(zip(got_tokens[i][: counts[i]], got_logprobs[i][: counts[i]], strict=True)) for i in range(n)]
