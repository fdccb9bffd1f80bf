"""An independent dense fp32 Llama forward: no pages, full sequence, HF rotate-half RoPE.

Written from the HF modeling code's equations, sharing nothing with the executor but the loaded
weights, so that the executor's paged, batched and masked paths can be checked against it.
"""

from __future__ import annotations

import math

import torch

from l4m.executor.weights import LoadedModel


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [T, heads, D]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@torch.inference_mode()
def reference_logits(
    model: LoadedModel,
    token_ids: list[int],
    positions: list[int] | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits `[T, vocab]` for every token; `mask` `[T, T]` bool (True = attend), default causal."""
    cfg, w = model.config, model.tensors
    n = len(token_ids)
    pos = torch.tensor(positions if positions is not None else list(range(n)))
    if mask is None:
        mask = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    group = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_heads, cfg.head_dim)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_kv_heads, cfg.head_dim)
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(cfg.head_dim)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        attn = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), v).reshape(n, -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], cfg.rms_norm_eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def reference_greedy(model: LoadedModel, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Greedy continuation (re-running the full sequence each step) and each step's top-2 margin."""
    tokens, margins = list(prompt), []
    for _ in range(num_new):
        logits = reference_logits(model, tokens)[-1]
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :], margins
