"""Bounded work per batch (issue 17): the executor refuses a batch whose reply could pass its gRPC send
limit, or whose masks carry more runs than values, before it costs any work; and the gRPC limits of every
hop hold the largest messages that valid commands and batches can produce, built here with every varint
at its longest and measured with ByteSize()."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from l4m.executor import convert
from l4m.executor.engine import Engine
from l4m.executor.errors import InvalidCommand
from l4m.executor.server import ExecutorServicer
from l4m.v1 import common_pb2, executor_pb2, l4m_pb2
from l4m.wire import limits

MAX_UINT32 = (1 << 32) - 1
MAX_UINT64 = (1 << 64) - 1
DISTRIBUTION = common_pb2.SAMPLER_KIND_DISTRIBUTION
GREEDY = common_pb2.SAMPLER_KIND_GREEDY


def distributions(num_outputs: int, top_k: int) -> common_pb2.ForwardTextItem:
    """A forward_text asking for `num_outputs` DISTRIBUTION outputs of `top_k` entries (two pages of 4)."""
    return common_pb2.ForwardTextItem(
        kv_page_ids=[0, 1], kv_last_page_length=4, token_ids=[1] * num_outputs, position_ids=range(num_outputs),
        output_indices=range(num_outputs),
        samplers=[common_pb2.SamplerSpec(kind=DISTRIBUTION, distribution_top_k=top_k)] * num_outputs,
    )


def forward_text_batch(*items: common_pb2.ForwardTextItem) -> executor_pb2.ExecuteRequest:
    return executor_pb2.ExecuteRequest(correlation_id=1, forward_text=executor_pb2.BatchForwardText(items=items))


def refusal(request: executor_pb2.ExecuteRequest) -> InvalidCommand:
    with pytest.raises(InvalidCommand) as caught:
        convert.batch_from_pb(request)
    return caught.value


# ---- the executor's own checks (convert.batch_from_pb) ----


def test_one_item_over_the_entries_bound_is_named() -> None:
    """The attack of issue 17 as the executor sees it: 256 outputs x the whole vocabulary (49,152)."""
    error = refusal(forward_text_batch(distributions(2, 1), distributions(256, 49152)))
    assert error.item_index == 1
    assert error.reason == ("forward_text item 1: asks for 12582912 distribution entries, more than "
                            f"max_distribution_entries_per_batch {limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH}")


def test_a_batch_over_the_entries_bound_only_together_names_no_item() -> None:
    half = limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH // 2
    assert len(convert.batch_from_pb(forward_text_batch(distributions(1, half), distributions(1, half)))) == 2
    error = refusal(forward_text_batch(distributions(1, half), distributions(1, half + 1)))
    assert error.item_index is None
    assert f"the forward_text batch asks for {2 * half + 1} distribution entries, more than" in error.reason


def test_a_sample_top_k_batch_over_the_entries_bound_is_refused() -> None:
    k = limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH // 2 + 1
    request = executor_pb2.ExecuteRequest(sample_top_k=executor_pb2.BatchSampleTopK(
        items=[common_pb2.SampleTopKItem(embed_slot_id=0, k=k)] * 2))
    assert f"the sample_top_k batch asks for {2 * k} distribution entries" in refusal(request).reason


def test_a_batch_whose_reply_bytes_could_pass_the_send_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy outputs carry no entries, but 32 bytes each at worst (the budget is scaled down here: the
    real one takes two million outputs)."""
    monkeypatch.setattr(convert, "MAX_BATCH_REPLY_BYTES", 1000)
    item = common_pb2.ForwardTextItem(samplers=[common_pb2.SamplerSpec(kind=GREEDY)] * 20)  # 16 + 20 x 32
    assert len(convert.batch_from_pb(forward_text_batch(item))) == 1
    error = refusal(forward_text_batch(item, item))
    assert error.item_index is None and error.reason == (
        "the forward_text batch's reply could take 1312 bytes, more than max_reply_bytes less the envelope (1000)")
    item = common_pb2.ForwardTextItem(samplers=[common_pb2.SamplerSpec(kind=GREEDY)] * 40)
    error = refusal(forward_text_batch(item))
    assert error.item_index == 0 and "forward_text item 0: its reply could take 1296 bytes" in error.reason


@pytest.mark.parametrize(("request_", "field"), [
    (forward_text_batch(common_pb2.ForwardTextItem(samplers=[common_pb2.SamplerSpec(
        kind=GREEDY, vocabulary_mask=common_pb2.Brle(run_lengths=[10] + [0] * 100))])), "vocabulary_mask has 101 runs"),
    (forward_text_batch(common_pb2.ForwardTextItem(attention_masks=[
        common_pb2.Brle(run_lengths=[1]), common_pb2.Brle(run_lengths=[2] + [0] * 10)])), "attention_masks[1] has 11 runs"),
    (executor_pb2.ExecuteRequest(mask_kv_page=executor_pb2.BatchMaskKvPage(items=[common_pb2.MaskKvPageItem(
        visibility=common_pb2.Brle(run_lengths=[0, 4] + [0] * 8))])), "visibility has 10 runs for 4 values"),
], ids=["vocabulary mask", "attention row", "page visibility"])
def test_masks_with_more_runs_than_twice_their_values_are_refused(request_, field) -> None:  # type: ignore[no-untyped-def]
    error = refusal(request_)
    assert error.item_index == 0 and field in error.reason and "allowed" in error.reason


def test_masks_within_the_run_bound_convert() -> None:
    """Zero-length runs are legal BRLE (l4m.v1.Brle): up to 2 x values + 1 runs pass."""
    item = common_pb2.ForwardTextItem(samplers=[common_pb2.SamplerSpec(
        kind=GREEDY, vocabulary_mask=common_pb2.Brle(run_lengths=[0] + [1, 0] * 10))])
    (converted,) = convert.batch_from_pb(forward_text_batch(item))
    assert converted.samplers[0].vocab_mask == (0,) + (1, 0) * 10


def test_get_info_advertises_the_limits(make_engine: Callable[..., Engine]) -> None:
    info = convert.info_to_pb(make_engine().get_info())
    assert info.max_request_bytes == limits.EXECUTOR_MAX_REQUEST_BYTES
    assert info.max_reply_bytes == limits.EXECUTOR_MAX_REPLY_BYTES
    assert info.max_distribution_entries_per_batch == limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH


def test_the_executor_refuses_the_attack_and_keeps_serving(make_engine: Callable[..., Engine]) -> None:
    """Through the servicer's batch path, on the real model: the 256 x vocabulary batch is answered with a
    BatchError naming the bound (not a reply the stream refuses), and the next batch is served."""
    engine = make_engine()
    servicer = ExecutorServicer(engine)
    try:
        vocab = engine.get_info().vocab_size
        allocate = executor_pb2.ExecuteRequest(correlation_id=1, allocate=executor_pb2.BatchAllocate(
            items=[common_pb2.AllocateItem(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=range(64))]))
        assert servicer._run_batch(allocate, 0) is None
        attack = distributions(256, vocab)
        attack.kv_page_ids[:] = range(64)
        reply = servicer._run_batch(forward_text_batch(attack), 0)
        assert reply is not None and reply.WhichOneof("result") == "error"
        assert "max_distribution_entries_per_batch" in reply.error.reason and reply.error.item_index == 0
        normal = distributions(2, 5)
        normal.kv_page_ids[:] = [64 - 1]
        normal.kv_last_page_length = 2
        reply = servicer._run_batch(forward_text_batch(normal), 0)
        assert reply is not None and reply.WhichOneof("result") == "forward_text"
        assert [len(o.distribution.token_ids) for o in reply.forward_text.items[0].outputs] == [5, 5]
    finally:
        servicer.close()


# ---- worst-case message sizes against the transport limits ----


def worst_result(num_distributions: int, top_k: int, num_tokens: int) -> common_pb2.ForwardTextResult:
    """A forward_text result with every id at 5 bytes: distributions of `top_k` entries, then sampled tokens."""
    distribution = common_pb2.OutputResult(distribution=common_pb2.Distribution(
        token_ids=[MAX_UINT32] * top_k, probabilities=[0.5] * top_k))
    token = common_pb2.OutputResult(token=common_pb2.SampledToken(token_id=MAX_UINT32, logprob=-1e30))
    return common_pb2.ForwardTextResult(outputs=[distribution] * num_distributions + [token] * num_tokens)


@pytest.mark.parametrize(("num_distributions", "top_k", "num_greedy", "num_steps"), [
    (0, 0, 0, 0), (0, 0, 1, 0), (1, 1, 0, 0), (1, 49152, 0, 0), (256, 4096, 0, 0), (3, 200_000, 5, 0),
    (0, 0, 1, 64), (0, 0, 8192, 0),
])
def test_reply_bytes_bounds_the_worst_case_of_every_shape(num_distributions, top_k, num_greedy, num_steps) -> None:  # type: ignore[no-untyped-def]
    samplers = [common_pb2.SamplerSpec(kind=DISTRIBUTION, distribution_top_k=top_k)] * num_distributions + \
        [common_pb2.SamplerSpec(kind=GREEDY)] * num_greedy
    item = common_pb2.ForwardTextItem(samplers=samplers, num_continuation_steps=num_steps)
    result = worst_result(num_distributions, top_k, num_greedy + num_steps)
    in_batch = executor_pb2.BatchForwardTextResult(items=[result]).ByteSize()
    in_session = l4m_pb2.SessionResponse(stream_id=MAX_UINT32, request_id=MAX_UINT64, forward_text=result).ByteSize()
    bound = limits.reply_bytes("forward_text", item)
    assert in_batch <= bound
    assert in_session <= bound + limits.ITEM_BYTES  # the rest of the SessionResponse's envelope is in the margin
    sample = common_pb2.SampleTopKItem(k=max(top_k, 1))
    distribution = common_pb2.Distribution(token_ids=[MAX_UINT32] * sample.k, probabilities=[0.5] * sample.k)
    assert executor_pb2.BatchSampleTopKResult(items=[distribution]).ByteSize() <= limits.reply_bytes("sample_top_k", sample)


def test_the_largest_valid_forward_text_batch_reply_fits_the_executors_send_limit() -> None:
    """Every distribution entry the executor allows one batch, then greedy outputs up to its reply budget:
    the batch passes the executor's checks, and its reply, built at its worst, fits the send limit."""
    num_items, max_entries = 128, limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH
    top_k = max_entries // num_items
    items = [distributions(1, top_k) for _ in range(num_items)]
    used = sum(limits.reply_bytes("forward_text", item) for item in items)
    num_greedy = (convert.MAX_BATCH_REPLY_BYTES - used - limits.ITEM_BYTES) // limits.OUTPUT_BYTES
    items.append(common_pb2.ForwardTextItem(samplers=[common_pb2.SamplerSpec(kind=GREEDY)] * num_greedy))
    convert.check_reply_bounds("forward_text", items)  # valid: at the bounds, not past them
    results = [worst_result(1, top_k, 0)] * num_items + [worst_result(0, 0, num_greedy)]
    reply = executor_pb2.ExecuteResponse(correlation_id=MAX_UINT64,
                                         forward_text=executor_pb2.BatchForwardTextResult(items=results))
    assert reply.ByteSize() <= limits.EXECUTOR_MAX_REPLY_BYTES
    assert max_entries * limits.DISTRIBUTION_ENTRY_BYTES > limits.EXECUTOR_MAX_REPLY_BYTES // 2  # a full batch


def test_the_largest_command_reply_fits_the_controllers_stream() -> None:
    """The scheduler's per-command bound, as distributions over the whole vocabulary, in a SessionResponse."""
    vocab = 49152
    num_outputs = limits.DEFAULT_MAX_DISTRIBUTION_ENTRIES_PER_COMMAND // vocab
    response = l4m_pb2.SessionResponse(stream_id=MAX_UINT32, request_id=MAX_UINT64,
                                       forward_text=worst_result(num_outputs, vocab, 0))
    assert response.ByteSize() <= limits.MAX_RESPONSE_BYTES
    assert limits.DEFAULT_MAX_DISTRIBUTION_ENTRIES_PER_COMMAND <= limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH


def test_the_largest_command_fits_the_executors_receive_limit_after_its_ids_are_rewritten() -> None:
    """A SessionRequest of exactly the scheduler's receive limit, its virtual ids of 1 byte rewritten into
    physical ids of 5, in a batch with a trace context, fits what the executor accepts."""
    num_ids = 4096
    item = common_pb2.EmbedImageItem(embed_slot_ids=[0] * num_ids)
    request = l4m_pb2.SessionRequest(stream_id=MAX_UINT32, request_id=MAX_UINT64, embed_image=item)
    request.embed_image.image_bytes = b"\0" * (limits.MAX_COMMAND_BYTES - request.ByteSize() - 8)
    assert limits.MAX_COMMAND_BYTES - 8 <= request.ByteSize() <= limits.MAX_COMMAND_BYTES
    rewritten = common_pb2.EmbedImageItem(embed_slot_ids=[MAX_UINT32] * num_ids,
                                          image_bytes=request.embed_image.image_bytes)
    batch = executor_pb2.ExecuteRequest(
        correlation_id=MAX_UINT64, embed_image=executor_pb2.BatchEmbedImage(items=[rewritten]),
        trace_context=common_pb2.TraceContext(traceparent="00-" + "f" * 32 + "-" + "f" * 16 + "-01"))
    assert batch.ByteSize() <= limits.EXECUTOR_MAX_REQUEST_BYTES
