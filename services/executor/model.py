"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied head, optional linear biases)
over the paged KV cache; the architectures it serves are those of `architectures.py` (a sliding
window is the attention plans' business).

Tokens of all items of a batch are concatenated (`[N, hidden]`) through every linear layer; only
attention looks at items separately, via the batch's `AttentionPlan` (ragged: a prefill chunk and decode
steps in one batch attend in calls of their own, see `attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from l4m.executor.attention import AttentionPlan, DecodePlan, MixedSplit, paged_attention
from l4m.executor.kv_cache import KvCache
from l4m.executor.quant import Linear, cat_rows, into_huge_pages
from l4m.executor.weights import LoadedModel, ModelConfig

MLP_ROWS = 512
"""Rows per pass through an MLP. A prefill's `gate_up` output is 12 kB per token in float32: 6,400 tokens'
(64 prompts of 100) are 78 MB, far past the last-level cache, so `silu`, the product and `down` would
each stream it from memory. In blocks of 512 rows (6 MB) they find it in cache (6,400 tokens: 993 -> 1,251
tok/s on a 2-core AVX-512 host). 512 is also the block the AVX-512 4-bit kernels take rows in, so the
blocks make the same kernel calls as one call would. CPU only: a GPU's GEMMs want all the rows at once."""


def _row_blocks(num_rows: int) -> list[slice]:
    return [slice(start, min(num_rows, start + MLP_ROWS)) for start in range(0, num_rows, MLP_ROWS)]


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(H + 2 * KVH) * D, hidden], q, k, v fused
    o: Linear  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * ffn, hidden], gate, up fused
    down: Linear  # [hidden, ffn]


FLOAT16_MAX = 65504.0


def _kv_values(kv: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K/V as a cache of `cache_dtype` stores them: a float16 cache clamps to its finite range first (as
    the CPU kernels write it), so a large value is rounded to +-65504, never to inf; NaN stays NaN."""
    if cache_dtype == torch.float16 and kv.dtype != torch.float16:
        return kv.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(cache_dtype)
    return kv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """The model's weights on one device, and its forward.

    With `quantized=True` (CPU, float32), every linear weight that the GGUF stored as Q4_1 / Q8_0 blocks
    also keeps those blocks, and calls of at most `max_quantized_rows` tokens multiply with them. When
    every layer's weights have blocks, `forward_decode` runs single-token batches through the whole
    stack in one C++ call (`has_decode_kernel`), and `forward_mixed` such steps beside a prefill chunk.
    With `dense_linears=False` (the engine's choice when `max_quantized_rows` covers every batch it
    accepts) such linears keep only the blocks: no float32 copy that no call would read (~700 MB for
    SmolLM2: the layers' weights and the fused qkv / gate_up copies).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        dtype: torch.dtype,
        device: torch.device,
        quantized: bool = False,
        max_quantized_rows: int = 0,
        dense_linears: bool = True,
        bf16_x: bool = False,
    ) -> None:
        self.config: ModelConfig = loaded.config
        self.dtype = dtype
        self.bf16_x = bf16_x
        self.device = device
        t = loaded.tensors

        def w(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            return t[name].to(device=device, dtype=as_dtype).contiguous()

        def linear(*names: str, dense: torch.Tensor | None = None) -> Linear:
            blocks = [loaded.quantized.get(n) for n in names] if quantized else [None]
            packed = cat_rows(blocks) if all(b is not None for b in blocks) else None  # type: ignore[arg-type]
            if packed is not None and not dense_linears:
                return Linear(None, packed, max_quantized_rows, bias(names), bf16_x)
            if dense is None:
                dense = torch.cat([w(n) for n in names]).contiguous() if len(names) > 1 else w(names[0])
            return Linear(dense, packed, max_quantized_rows, bias(names), bf16_x)

        def bias(names: tuple[str, ...]) -> torch.Tensor | None:
            """The fused bias of `names` (zeros for parts without one), or None when none has one."""
            biases = [t.get(n.removesuffix(".weight") + ".bias") for n in names]
            if all(b is None for b in biases):
                return None
            sizes = [t[n].shape[0] for n in names]
            parts = [torch.zeros(size) if b is None else b for b, size in zip(biases, sizes, strict=True)]
            return torch.cat(parts).to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        if "lm_head.weight" in t:
            self.head = linear("lm_head.weight")  # [V, hidden]
        else:
            self.head = linear("model.embed_tokens.weight", dense=self.embed)  # tied
        # Norm weights stay float32: the residual stream is float32 whatever `dtype` (see `forward`).
        self.final_norm = w("model.norm.weight", torch.float32)
        self.layers = []
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight", torch.float32),
                    qkv=linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                    o=linear(p + "self_attn.o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight", torch.float32),
                    gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=linear(p + "mlp.down_proj.weight"),
                )
            )
        if quantized:  # one mapping on huge pages for every block the decode steps stream
            blocked = [lin for lin in self._linears() if lin.quantized is not None]
            for lin, moved in zip(blocked, into_huge_pages([lin.quantized for lin in blocked]), strict=True):
                lin.quantized = moved
        self._decode_weights = self._pack_decode_weights() if quantized else None
        # Quantized weights mean the CPU kernels are loaded: mixed batches' decode steps attend there.
        self._decode_attention_kernel = quantized and dtype == torch.float32 and self.config.head_dim in (64, 128)
        cfg = self.config
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        )
        if "rope_freq_factors" in t:
            inv_freq = inv_freq / t["rope_freq_factors"].double()
        angles = torch.outer(torch.arange(cfg.max_context, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [max_context, D], rotate-half layout
        self.rope_cos = angles.cos().float().to(device)
        self.rope_sin = angles.sin().float().to(device)

    def _linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.head]

    def _pack_decode_weights(self) -> list[torch.Tensor] | None:
        """The flat per-layer weight list `decode_layers` takes, or None if the kernel does not apply."""
        if self.config.head_dim not in (64, 128):  # the kernel's attention is specialised for these
            return None
        if any(lin.bias is not None for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            return None  # the kernel has no bias terms: such models decode on the torch path
        flat: list[torch.Tensor] = []
        no_m = torch.empty(0)  # Q8_0 blocks have no offsets
        for layer in self.layers:
            blocks = [lin.quantized for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(q is None for q in blocks):
                return None
            qkv, o, gate_up, down = ((q.qs, q.d, no_m if q.m is None else q.m) for q in blocks)  # type: ignore[union-attr]
            flat.extend((layer.input_norm, *qkv, *o, layer.post_norm, *gate_up, *down))
        return flat

    @property
    def has_decode_kernel(self) -> bool:
        return self._decode_weights is not None

    def forward_decode(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        plan: DecodePlan,
        cache: KvCache,
        output_rows: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` for a batch of single-token items, in one kernel call; same result and effects."""
        cfg = self.config
        out = torch.ops.l4m_cpu.decode_layers(
            hidden,
            self.rope_cos[positions],  # [B, D]
            self.rope_sin[positions],
            self._decode_weights,
            cache.layers,
            plan.page_table,
            plan.ctx_len,
            plan.visible,
            cfg.num_heads,
            cfg.rms_norm_eps,
            self.final_norm,
            self.bf16_x,
        )  # [B, hidden], after the final norm
        # One output per item, in order, is every row (rows of single-token items are unique and sorted).
        return out if output_rows.numel() == out.shape[0] else out[output_rows]

    def forward_mixed(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        split: MixedSplit,
        cache: KvCache,
        output_rows: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` for decode steps beside one padded group (`attention.split_mixed`), in one kernel
        call: the decode steps as in `forward_decode`, every linear once over all rows; same result and
        effects. The kernel takes the decode steps' rows first (`split.order`)."""
        cfg = self.config
        order = split.order
        kernel_row = torch.empty_like(order)
        kernel_row[order] = torch.arange(order.numel())
        write_slots = (plan.write_pages * cache.page_size + plan.write_offsets)[order]
        dead = kernel_row[plan.dead_rows] if plan.dead_rows is not None else order.new_zeros(0)
        positions = positions[order]
        out = torch.ops.l4m_cpu.mixed_layers(
            hidden[order],
            self.rope_cos[positions],  # [N, D]
            self.rope_sin[positions],
            self._decode_weights,
            cache.layers,
            split.decode.page_table,
            split.decode.ctx_len,
            split.decode.visible,
            write_slots,
            split.group.kv_index,
            split.group.mask,
            dead,
            cfg.num_heads,
            cfg.rms_norm_eps,
            self.bf16_x,
        )  # [N, hidden] in kernel rows, before the final norm
        return F.rms_norm(out[kernel_row[output_rows]], (cfg.hidden_size,), self.final_norm, cfg.rms_norm_eps)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed)  # [N, hidden]

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        cache: KvCache,
        output_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run all layers on `hidden` `[N, hidden]`, writing K/V into the cache.

        Returns the final-normed hidden states of `output_rows` (`[M, hidden]`, `dtype`), the LM head's
        input. The residual stream and the norms are float32 whatever `dtype` (as llama.cpp keeps its
        activations): with bfloat16 only the matmul inputs, the attention and the KV cache are rounded,
        which halves the logit error against float32 (a bfloat16 residual accumulates a rounding per layer).
        """
        cfg = self.config
        num_tokens = hidden.shape[0]
        hidden = hidden.float()
        dtype = self.dtype
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        cos = self.rope_cos[positions].to(self.dtype)[:, None, :]  # [N, 1, D]
        sin = self.rope_sin[positions].to(self.dtype)[:, None, :]
        row_blocks = _row_blocks(num_tokens) if self.device.type == "cpu" else [slice(None)]
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            h = F.rms_norm(hidden, (cfg.hidden_size,), layer.input_norm, cfg.rms_norm_eps).to(dtype)
            q, k, v = layer.qkv(h).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kv[plan.write_pages, :, plan.write_offsets] = _kv_values(torch.stack((k, v.view_as(k)), dim=1), kv.dtype)
            attn = paged_attention(q, kv, plan, self._decode_attention_kernel)  # [N, H * D]
            hidden = hidden + layer.o(attn).float()
            for rows in row_blocks:  # in place: `hidden` is this layer's own sum
                hidden[rows] += self._mlp(layer, hidden[rows])
        return F.rms_norm(hidden[output_rows], (cfg.hidden_size,), self.final_norm, cfg.rms_norm_eps).to(dtype)

    def _mlp(self, layer: LayerWeights, hidden: torch.Tensor) -> torch.Tensor:
        """The MLP's output for the residual rows `hidden`, float32."""
        cfg = self.config
        h = F.rms_norm(hidden, (cfg.hidden_size,), layer.post_norm, cfg.rms_norm_eps).to(self.dtype)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up).float()

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """`[M, hidden]` -> float32 logits `[M, vocab]`."""
        return self.head(normed).float()
