"""One rulebook (`l4m.wire.rules`): a forward_text that breaks a rule of the protocol is refused with the
same words by the scheduler's validation, the executor's own checks and the SDK's FakeL4M; each only puts
where it caught it in front."""

from __future__ import annotations

import asyncio

import pytest
import torch

from l4m.executor import checks
from l4m.executor.convert import _forward_text_from_pb
from l4m.executor.errors import InvalidCommand as ExecutorInvalid
from l4m.executor.kv_cache import KvCache
from l4m.executor.weights import ModelConfig
from l4m.fake import FakeL4M
from l4m.scheduler import requests as rq
from l4m.scheduler.errors import InvalidCommand as SchedulerInvalid
from l4m.scheduler.validation import ModelLimits, check_forward_text
from l4m.v1 import common_pb2, l4m_pb2

VOCAB, PAGE_SIZE, MAX_CONTEXT = 300, 4, 8192  # the fake's max context
S = common_pb2.SamplerSpec
GREEDY = S(kind=common_pb2.SAMPLER_KIND_GREEDY)


def _ft(**kw: object) -> common_pb2.ForwardTextItem:
    """Two tokens on one page of 2 slots, overridden by kw."""
    args: dict[str, object] = {"pages": [0], "last_page_length": 2, "tokens": [1, 2], "positions": [0, 1]}
    args.update(kw)
    return rq.forward_text(**args).forward_text  # type: ignore[arg-type]


def _with(item: common_pb2.ForwardTextItem, **fields: object) -> common_pb2.ForwardTextItem:
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(item, name).extend(value)
        else:
            setattr(item, name, value)
    return item


CASES = [
    ("token outside the vocabulary", _ft(tokens=[1, VOCAB]), f"token_ids holds token id {VOCAB}, not in [0, vocab_size={VOCAB})"),
    ("length rule", _ft(tokens=[1, 2, 3], positions=[0, 1, 2]), "3 inputs do not fit the 2 token slots of 1 pages (length rule)"),
    ("positions per token", _ft(positions=[0]), "position_ids has 1 entries for 2 token_ids"),
    ("mask rule", _ft(masks=[[1], [5]]), "attention_masks[1] decodes to 5 values, expected 2"),
    ("output index", _ft(outputs=[2]), "output_indices holds 2, not in [0, num_inputs=2)"),
    ("sampler temperature", _ft(outputs=[1], samplers=[S(kind=common_pb2.SAMPLER_KIND_SAMPLE, temperature=0)]),
     "samplers[0]: temperature 0.0 is not a finite number > 0"),
    ("vocabulary mask allows nothing",
     _ft(outputs=[1], samplers=[S(kind=common_pb2.SAMPLER_KIND_GREEDY, vocabulary_mask=common_pb2.Brle(run_lengths=[0, VOCAB]))]),
     "samplers[0]: vocabulary_mask allows no token"),
    ("continuation under a mask",
     _with(_ft(last_page_length=3, outputs=[1], samplers=[GREEDY], masks=[[1], [2]]), num_continuation_steps=1),
     "continuation needs plain causal attention: attention_masks must be empty"),
    ("continuation stop ids alone", _with(_ft(outputs=[1], samplers=[GREEDY]), continuation_stop_token_ids=[2]),
     "continuation_stop_token_ids is set but num_continuation_steps is 0"),
]


def _scheduler_reason(item: common_pb2.ForwardTextItem) -> str:
    limits = ModelLimits(vocab_size=VOCAB, kv_page_size=PAGE_SIZE, max_context_tokens=MAX_CONTEXT, max_batch_tokens=4096,
                         max_kv_pages_per_instance=64, max_embed_slots_per_instance=0,
                         capabilities=frozenset({"text"}), max_continuation_steps=64)
    with pytest.raises(SchedulerInvalid) as caught:
        check_forward_text(item, limits)
    return caught.value.reason


def _executor_reason(item: common_pb2.ForwardTextItem) -> str:
    model = ModelConfig("tiny", num_layers=1, hidden_size=2, intermediate_size=2, num_heads=1, num_kv_heads=1,
                        head_dim=2, vocab_size=VOCAB, max_context=MAX_CONTEXT, rope_theta=1e4, rms_norm_eps=1e-5,
                        tie_word_embeddings=True)
    cache = KvCache(num_layers=1, num_pages=4, page_size=PAGE_SIZE, num_kv_heads=1, head_dim=2, num_embed_slots=1,
                    hidden_size=2, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ExecutorInvalid) as caught:
        checks.check_forward_text_item(_forward_text_from_pb(item, 0), cache, model, "forward_text item 0")
    return str(caught.value)


def _fake_reason(item: common_pb2.ForwardTextItem) -> str:
    async def run() -> l4m_pb2.SessionResponse:
        call = FakeL4M(vocab_size=VOCAB, kv_page_size=PAGE_SIZE).stub().Session()
        await call.write(rq.allocate([0]))
        await call.write(l4m_pb2.SessionRequest(request_id=9, forward_text=item))
        return await call.read()

    response = asyncio.run(run())
    assert response.HasField("trap") and response.trap.kind == l4m_pb2.TRAP_KIND_INVALID_COMMAND, response
    return response.trap.reason


@pytest.mark.parametrize(("case", "item", "rule"), CASES, ids=[c for c, _, _ in CASES])
def test_a_broken_rule_reads_the_same_in_the_scheduler_the_executor_and_the_fake(case, item, rule) -> None:  # type: ignore[no-untyped-def]
    reasons = {
        "scheduler": _scheduler_reason(_copy(item)),
        "executor": _executor_reason(_copy(item)),
        "fake": _fake_reason(_copy(item)),
    }
    for where, reason in reasons.items():
        assert reason.endswith(rule), f"{where}: {reason!r}"


def _copy(item: common_pb2.ForwardTextItem) -> common_pb2.ForwardTextItem:
    copy = common_pb2.ForwardTextItem()
    copy.CopyFrom(item)
    return copy
