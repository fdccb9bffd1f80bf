"""Every bad input traps its instance with a reason naming field and value; nothing else is disturbed
and everything the trapped instance held is freed. Simulated model: vocab 1000, page size 16,
max context 4096, max batch tokens 8192, 64 pages, 64 slots, text only."""

from __future__ import annotations

import pytest

from l4m.scheduler import requests as rq
from l4m.v1 import common_pb2, l4m_pb2
from l4m.wire import limits

INVALID = l4m_pb2.TRAP_KIND_INVALID_COMMAND
S = common_pb2.SamplerSpec


def ft(**kw):  # type: ignore[no-untyped-def]
    """A valid forward_text on pages [0, 1] (16 + 2 slots), feeding 2 tokens, overridden by kw."""
    args = {"pages": [0, 1], "last_page_length": 2, "tokens": [1, 2], "positions": [16, 17]}
    args.update(kw)
    return rq.forward_text(**args)


def cont(steps: int, stop_ids: tuple[int, ...] = (), **kw):  # type: ignore[no-untyped-def]
    """`ft` with its last token's output, a greedy sampler and `steps` continuation steps (the default
    pages, 18 slots, hold 2 tokens + up to 16 steps)."""
    request = ft(**{"outputs": [1], **kw})
    request.forward_text.num_continuation_steps = steps
    request.forward_text.continuation_stop_token_ids.extend(stop_ids)
    return request


def item(kind: str, **fields):  # type: ignore[no-untyped-def]
    messages = {
        "embed_text": common_pb2.EmbedTextItem, "forward": common_pb2.ForwardItem,
        "sample_top_k": common_pb2.SampleTopKItem, "copy_kv_page": common_pb2.CopyKvPageItem,
        "mask_kv_page": common_pb2.MaskKvPageItem, "embed_image": common_pb2.EmbedImageItem,
    }
    return rq.request(**{kind: messages[kind](**fields)})


BAD = [
    ("no command", rq.request(), "carries no command"),
    ("allocate kind", rq.allocate([5], kind=0), "kind 0 is not KV_PAGE"),
    ("allocate empty", rq.allocate([]), "ids is empty"),
    ("allocate dup", rq.allocate([5, 5]), "lists an id twice"),
    ("allocate taken", rq.allocate([0]), "kv page id 0 is already allocated"),
    ("allocate too many", rq.allocate(list(range(100, 200))), "more than the 64"),
    ("deallocate unowned", rq.deallocate([9]), "kv page 9 is not allocated"),
    ("deallocate slot unowned", rq.deallocate([9], kind=rq.EMBED_SLOT), "embed slot 9 is not allocated"),
    ("ft no pages", ft(pages=[]), "kv_page_ids is empty"),
    ("ft dup page", ft(pages=[0, 0]), "lists a page twice"),
    ("ft last zero", ft(last_page_length=0), "kv_last_page_length 0 is not in [1, kv_page_size=16]"),
    ("ft last big", ft(last_page_length=17), "kv_last_page_length 17"),
    ("ft no tokens", ft(tokens=[], positions=[]), "token_ids is empty"),
    ("ft positions count", ft(positions=[1]), "position_ids has 1 entries for 2 token_ids"),
    ("ft length rule", ft(pages=[0], last_page_length=1), "2 inputs do not fit the 1 token slots"),
    ("ft vocab", ft(tokens=[1, 1000]), "token id 1000, not in [0, vocab_size=1000)"),
    ("ft position", ft(positions=[1, 4096]), "position 4096, not in [0, max_context_tokens=4096)"),
    ("ft mask rows", ft(masks=[[17]]), "attention_masks has 1 rows for 2 tokens"),
    ("ft mask length", ft(masks=[[17], [17]]), "attention_masks[1] decodes to 17 values, expected 18"),
    ("ft output index", ft(outputs=[2]), "output_indices holds 2, not in [0, num_inputs=2)"),
    ("ft output dup", ft(outputs=[1, 1]), "lists an index twice"),
    ("ft samplers count", ft(outputs=[1], samplers=[]), "samplers has 0 entries for 1 output_indices"),
    ("ft sampler kind", ft(outputs=[1], samplers=[S()]), "samplers[0]: kind 0 is not DISTRIBUTION"),
    ("ft dist k", ft(outputs=[1], samplers=[S(kind=1, distribution_top_k=0)]), "distribution_top_k 0"),
    ("ft temperature", ft(outputs=[1], samplers=[S(kind=3, temperature=0)]), "temperature 0.0 is not a finite"),
    ("ft temperature nan", ft(outputs=[1], samplers=[S(kind=3, temperature=float("nan"))]), "temperature nan"),
    ("ft top_k", ft(outputs=[1], samplers=[S(kind=3, temperature=1, top_k=1001)]), "samplers[0]: top_k 1001 is not in [0, vocab_size=1000]"),
    ("ft top_p", ft(outputs=[1], samplers=[S(kind=3, temperature=1, top_p=1.5)]), "top_p 1.5 is not in [0, 1]"),
    ("ft min_p", ft(outputs=[1], samplers=[S(kind=3, temperature=1, min_p=1)]), "min_p 1.0 is not in [0, 1)"),
    ("ft vocab mask len", ft(outputs=[1], samplers=[S(kind=2, vocabulary_mask=common_pb2.Brle(run_lengths=[5]))]),
     "vocabulary_mask decodes to 5 values, expected 1000"),
    ("ft vocab mask none", ft(outputs=[1], samplers=[S(kind=2, vocabulary_mask=common_pb2.Brle(run_lengths=[0, 1000]))]),
     "allows no token"),
    ("ft output count", ft(outputs=[0, 1, 0], samplers=[S(kind=2)]), "output_indices lists 3 indices for 2 inputs"),
    ("ft vocab mask runs", ft(outputs=[1], samplers=[S(kind=2, vocabulary_mask=common_pb2.Brle(
        run_lengths=[1000] + [0] * 2001))]), "vocabulary_mask has 2002 runs, more than the 2001 a mask of 1000 values"),
    ("ft mask runs", ft(masks=[[17] + [0] * 40, [18]]), "attention_masks[0] has 41 runs, more than the 35"),
    ("ft samplers over tokens", ft(outputs=[1], samplers=[S(kind=2)] * 3), "samplers has 3 entries for 2 token_ids"),
    ("ft bias id", ft(outputs=[1], samplers=[S(kind=2, logit_bias_token_ids=[1000], logit_bias_values=[1])]),
     "samplers[0]: logit_bias_token_ids holds token id 1000"),
    ("ft bias nan", ft(outputs=[1], samplers=[S(kind=2, logit_bias_token_ids=[5], logit_bias_values=[float("nan")])]),
     "logit_bias value nan of token 5 is not finite"),
    ("ft bias inf", ft(outputs=[1], samplers=[S(kind=3, temperature=1, logit_bias_token_ids=[5],
                                                  logit_bias_values=[float("-inf")])]), "value -inf of token 5"),
    ("ft bias twice", ft(outputs=[1], samplers=[S(kind=2, logit_bias_token_ids=[5, 5], logit_bias_values=[1, 2])]),
     "logit_bias_token_ids lists a token id twice"),
    ("ft bias lengths", ft(outputs=[1], samplers=[S(kind=2, logit_bias_token_ids=[5], logit_bias_values=[])]),
     "logit_bias_token_ids has 1 entries but logit_bias_values 0"),
    ("ft bias count", ft(outputs=[1], samplers=[S(kind=2, logit_bias_token_ids=list(range(65537)),
                                                  logit_bias_values=[0.0] * 65537)]),
     "logit_bias has 65537 entries, more than 65536"),
    ("ft top_logprobs", ft(outputs=[1], samplers=[S(kind=2, top_logprobs=21)]), "top_logprobs 21 is not in [0, 20]"),
    ("ft top_logprobs dist", ft(outputs=[1], samplers=[S(kind=1, distribution_top_k=2, top_logprobs=1)]),
     "top_logprobs must be 0 for a DISTRIBUTION sampler"),
    ("ft mask runs in all", ft(tokens=[1] * 600, positions=list(range(600)), pages=list(range(38)), last_page_length=8,
                               outputs=list(range(600)), samplers=[S(kind=2, vocabulary_mask=common_pb2.Brle(
                                   run_lengths=[0] + [1, 0] * 1000))] * 600),
     "the masks carry 1200600 BRLE runs in all, more than max_mask_runs_per_command 1048576"),
    ("ft unowned page", ft(pages=[0, 7]), "kv page 7 is not allocated"),
    ("ft context tokens", ft(tokens=[1] * 4097, positions=[1] * 4097),
     "4097 token_ids exceed the context window, max_context_tokens 4096"),
    ("ft too many pages", ft(pages=list(range(65))), "65 pages, more than max_kv_pages_per_instance 64"),
    ("cont too many", cont(65, pages=[0, 1] + list(range(2, 6)), last_page_length=3),
     "num_continuation_steps 65 is not in [0, max_continuation_steps=64]"),
    ("cont stop ids alone", cont(0, (5,)), "continuation_stop_token_ids is set but num_continuation_steps is 0"),
    ("cont masks", cont(1, masks=[[16], [17]]), "attention_masks must be empty"),
    ("cont output", cont(1, outputs=[0]), "exactly one output index, the last token's (1), not [0]"),
    ("cont distribution", cont(1, samplers=[S(kind=1, distribution_top_k=3)]), "GREEDY or SAMPLE sampler"),
    ("cont vocab mask", cont(1, samplers=[S(kind=2, vocabulary_mask=common_pb2.Brle(run_lengths=[999, 1]))]),
     "without a vocabulary mask"),
    ("cont stop vocab", cont(1, (1000,)), "continuation_stop_token_ids holds token id 1000"),
    ("cont length rule", cont(17), "19 inputs do not fit the 18 token slots"),
    ("cont position", cont(5, positions=[4090, 4091]), "5 continuation steps after position 4091 pass"),
    ("embed_text counts", item("embed_text", embed_slot_ids=[0], token_ids=[1, 2], position_ids=[0]), "they must match"),
    ("embed_text vocab", item("embed_text", embed_slot_ids=[0], token_ids=[5000], position_ids=[0]), "token id 5000"),
    ("embed_text slot", item("embed_text", embed_slot_ids=[9], token_ids=[1], position_ids=[0]), "embed slot 9 is not"),
    ("forward no inputs", item("forward", kv_page_ids=[0], kv_last_page_length=1), "input_embed_slot_ids is empty"),
    ("forward length", item("forward", kv_page_ids=[0], kv_last_page_length=1, input_embed_slot_ids=[0, 1]),
     "2 inputs do not fit the 1 token slots"),
    ("forward outputs", item("forward", kv_page_ids=[0], kv_last_page_length=2, input_embed_slot_ids=[0, 1],
                             output_indices=[0]), "output_embed_slot_ids has 0 entries for 1"),
    ("forward unowned slot", item("forward", kv_page_ids=[0], kv_last_page_length=1, input_embed_slot_ids=[7]),
     "embed slot 7 is not allocated"),
    ("sample k", item("sample_top_k", embed_slot_id=0, k=0), "k 0 is not in [1, vocab_size=1000]"),
    ("sample slot", item("sample_top_k", embed_slot_id=7, k=1), "embed slot 7 is not allocated"),
    ("copy zero", item("copy_kv_page", source_kv_page_id=0, destination_kv_page_id=1), "length_tokens is 0"),
    ("copy source", item("copy_kv_page", source_kv_page_id=0, destination_kv_page_id=1, source_offset_tokens=10,
                         length_tokens=7), "source range [10, 17) exceeds kv_page_size 16"),
    ("copy destination", item("copy_kv_page", source_kv_page_id=0, destination_kv_page_id=1,
                              destination_offset_tokens=16, length_tokens=1), "destination range [16, 17)"),
    ("copy unowned", item("copy_kv_page", source_kv_page_id=0, destination_kv_page_id=5, length_tokens=1),
     "kv page 5 is not allocated"),
    ("mask length", item("mask_kv_page", kv_page_id=0, visibility=common_pb2.Brle(run_lengths=[15])),
     "visibility decodes to 15 values, expected 16"),
    ("mask runs", item("mask_kv_page", kv_page_id=0, visibility=common_pb2.Brle(run_lengths=[16] + [0] * 40)),
     "visibility has 41 runs, more than the 33"),
    ("mask unowned", item("mask_kv_page", kv_page_id=3, visibility=common_pb2.Brle(run_lengths=[16])),
     "kv page 3 is not allocated"),
    ("export name", rq.export("", [0]), "name '' is 0 bytes"),
    ("export long name", rq.export("n" * 257, [0]), "is 257 bytes"),
    ("export metadata", rq.export("m", [0], metadata=b"x" * ((1 << 20) + 1)), "metadata is 1048577 bytes"),
    ("import empty", rq.import_pages("m", []), "kv_page_ids is empty"),
    ("priority", rq.request(set_stream_priority=l4m_pb2.SetStreamPriorityCommand(priority=0)), "priority 0 is not"),
    ("debug unknown", rq.debug_query("format disk"), "debug_query 'format disk' is unknown"),
    ("debug strategy", rq.debug_query("batching:k-only:0"), "bad batching strategy"),
]


@pytest.mark.parametrize(("case", "bad", "reason"), BAD, ids=[c for c, _, _ in BAD])
async def test_bad_command_traps_only_its_instance_and_frees_it(harness_factory, case, bad, reason) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    good, good_sink = h.open("good")
    h.send(good, rq.allocate([0, 1]))
    offender, sink = h.open("offender")
    h.send(offender, rq.allocate([0, 1]), rq.allocate([0, 1], kind=rq.EMBED_SLOT))
    bad.request_id = 77
    h.send(offender, bad)
    h.send(good, ft(outputs=[1], request_id=5))
    await h.settle()
    assert sink.trap is not None, case
    assert sink.trap.kind == INVALID, sink.trap
    assert reason in sink.trap.reason, sink.trap.reason
    assert sink.trap.offending_request_id == 77
    assert sink.events[-1].trap == sink.trap
    assert good.is_alive and [e.request_id for e in good_sink.of("forward_text")] == [5]
    assert h.free_pages() == 62 and h.free_slots() == 64
    assert h.sim().num_errors == 0


async def test_embed_image_on_a_text_model_is_unsupported(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    inst, sink = h.open()
    h.send(inst, item("embed_image", embed_slot_ids=[0], image_bytes=b"png"))
    await h.settle()
    assert sink.trap.kind == l4m_pb2.TRAP_KIND_UNSUPPORTED and "vision" in sink.trap.reason  # type: ignore[union-attr]


async def test_commands_after_a_trap_are_ignored(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    inst, sink = h.open()
    h.send(inst, rq.deallocate([1]), rq.allocate([1]))
    await h.settle()
    assert len(sink.events) == 1 and h.free_pages() == 64


# ---- bounded work per command (l4m.wire.limits): distribution entries, reply bytes, mask runs ----


def distributions(num_outputs: int, top_k: int, num_tokens: int = 2):  # type: ignore[no-untyped-def]
    """A forward_text on pages [0, 1] asking for `num_outputs` DISTRIBUTION outputs of `top_k` entries."""
    tokens = [1] * num_tokens
    return ft(tokens=tokens, positions=list(range(16, 16 + num_tokens)), last_page_length=num_tokens,
              outputs=list(range(num_outputs)), samplers=[S(kind=1, distribution_top_k=top_k)] * num_outputs)


async def test_distribution_entries_are_bounded_per_command_by_the_executor_and_the_scheduler(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """The executor allows 2,000 entries per batch, less than the scheduler's default: 2 x 1,000 pass, 3 x 1,000
    trap naming the field, the value and the limit; GetInfo tells the bound; the bystander is served."""
    h = harness_factory(max_distribution_entries_per_batch=2000)
    assert h.scheduler.get_info().max_distribution_entries_per_command == 2000
    good, good_sink = h.open("good")
    offender, sink = h.open("offender")
    h.send(good, rq.allocate([0, 1]), distributions(2, 1000, num_tokens=2))
    h.send(offender, rq.allocate([0, 1]), distributions(3, 1000, num_tokens=3))
    await h.settle()
    assert sink.trap is not None and sink.trap.kind == INVALID
    assert ("samplers ask for 3000 distribution entries (outputs x distribution_top_k), more than "
            "max_distribution_entries_per_command 2000") in sink.trap.reason
    (reply,) = good_sink.of("forward_text")
    assert [len(o.distribution.token_ids) for o in reply.forward_text.outputs] == [1000, 1000]
    assert good.is_alive and h.free_pages() == 62 and h.sim().num_errors == 0


async def test_the_per_command_bound_is_the_schedulers_default_when_the_executor_allows_more(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(max_distribution_entries_per_batch=1 << 30)
    info = h.scheduler.get_info()
    assert info.max_distribution_entries_per_command == limits.DEFAULT_MAX_DISTRIBUTION_ENTRIES_PER_COMMAND
    assert info.max_tokens_per_command == 8192
    assert info.max_mask_runs_per_command == limits.DEFAULT_MAX_MASK_RUNS_PER_COMMAND
    assert (info.max_command_bytes, info.max_response_bytes) == (limits.MAX_COMMAND_BYTES, limits.MAX_RESPONSE_BYTES)


async def test_sample_top_k_k_is_bounded_by_the_per_command_entries(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(max_distribution_entries_per_batch=500)
    inst, sink = h.open()
    h.send(inst, rq.allocate([0], kind=rq.EMBED_SLOT), item("sample_top_k", embed_slot_id=0, k=600))
    await h.settle()
    assert sink.trap is not None and sink.trap.kind == INVALID
    assert "k 600 asks for more than max_distribution_entries_per_command 500" in sink.trap.reason
    assert h.free_slots() == 64


async def test_a_reply_that_could_pass_the_reply_bytes_bound_traps(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """400 greedy outputs could take 16 + 400 x 32 bytes; with 10,000 bytes allowed per reply the command traps
    before it reaches a batch, naming the bytes and the limit."""
    h = harness_factory(max_reply_bytes=limits.MESSAGE_MARGIN_BYTES + 10_000)
    inst, sink = h.open()
    pages = list(range(25))
    h.send(inst, rq.allocate(pages),
           rq.forward_text(pages, 16, [1] * 400, outputs=list(range(400))))
    await h.settle()
    assert sink.trap is not None and sink.trap.kind == INVALID
    assert f"the reply could take {limits.reply_bytes('forward_text', _greedy_item(400))} bytes, more than " \
           "max_reply_bytes 10000" in sink.trap.reason
    assert h.free_pages() == 64 and h.sim().num_errors == 0


def _greedy_item(num_outputs: int) -> common_pb2.ForwardTextItem:
    return common_pb2.ForwardTextItem(samplers=[S(kind=2)] * num_outputs)


async def test_millions_of_zero_length_mask_runs_are_refused_before_they_are_read(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """The attack of issue 17: a vocabulary mask of 3 x 10^6 zero-length runs (legal runs, a legal length)
    traps at validation, on the count of its runs alone (they are never summed); the bystander's step in the
    same scheduler is served, and the executor never sees the mask."""
    h = harness_factory()
    good, good_sink = h.open("good")
    offender, sink = h.open("offender")
    h.send(good, rq.allocate([0, 1]))
    mask = common_pb2.Brle(run_lengths=[1000] + [0] * 3_000_000)
    h.send(offender, rq.allocate([0, 1]), ft(outputs=[1], samplers=[S(kind=2, vocabulary_mask=mask)], request_id=9))
    h.send(good, ft(outputs=[1], request_id=5))
    await h.settle()
    assert sink.trap is not None and sink.trap.kind == INVALID and sink.trap.offending_request_id == 9
    assert ("the masks carry 3000001 BRLE runs in all, more than max_mask_runs_per_command "
            f"{limits.DEFAULT_MAX_MASK_RUNS_PER_COMMAND}") in sink.trap.reason
    assert [e.request_id for e in good_sink.of("forward_text")] == [5] and good.is_alive
    assert h.free_pages() == 62 and h.sim().num_errors == 0


COSTED = [  # forward_text shapes whose reply cost validation counts on the way (the hot path)
    ("greedy", ft(outputs=[1])),
    ("no outputs", ft()),
    ("two greedy", ft(outputs=[0, 1])),
    ("distribution", ft(outputs=[1], samplers=[S(kind=1, distribution_top_k=7)])),
    ("top_logprobs", ft(outputs=[0, 1], samplers=[S(kind=2, top_logprobs=5), S(kind=3, temperature=1, top_logprobs=2)])),
    ("continuation", cont(9, samplers=[S(kind=2, top_logprobs=3)])),
    ("masked", ft(outputs=[1], samplers=[S(kind=2, vocabulary_mask=common_pb2.Brle(run_lengths=[10, 990]),
                                            logit_bias_token_ids=[3], logit_bias_values=[1.5])])),
]


@pytest.mark.parametrize("case, command", COSTED, ids=[c[0] for c in COSTED])
def test_forward_text_validation_counts_the_reply_cost_the_batcher_would(case, command) -> None:  # type: ignore[no-untyped-def]
    """The cost validation returns is `limits.reply_cost`'s, which the batcher computed itself before (the
    batch bounds rest on it), and a Command built with it costs what one built without it does."""
    from l4m.scheduler.batcher import Command, Stream
    from l4m.scheduler.kinds import KINDS
    from l4m.scheduler.validation import ModelLimits

    model = ModelLimits(vocab_size=1000, kv_page_size=16, max_context_tokens=4096, max_batch_tokens=8192,
                        max_kv_pages_per_instance=64, max_embed_slots_per_instance=64, capabilities=frozenset({"text"}),
                        max_continuation_steps=64)
    kind, item = KINDS["forward_text"], command.forward_text
    cost = kind.check(item, model)
    assert cost == limits.reply_cost("forward_text", item)
    stream = Stream(None, 0)
    given = Command(stream, 1, "forward_text", item, 0.0, 2, is_executor_kind=True, reply_cost=cost)
    counted = Command(stream, 1, "forward_text", item, 0.0, 2, is_executor_kind=True)
    assert (given.num_entries, given.reply_bytes, given.request_bytes) == \
        (counted.num_entries, counted.reply_bytes, counted.request_bytes)


def _model_limits(vocab_size: int = 1000):  # type: ignore[no-untyped-def]
    from l4m.scheduler.validation import ModelLimits

    return ModelLimits(vocab_size=vocab_size, kv_page_size=16, max_context_tokens=4096, max_batch_tokens=8192,
                       max_kv_pages_per_instance=64, max_embed_slots_per_instance=64,
                       capabilities=frozenset({"text"}), max_continuation_steps=64)


def test_a_sampler_checked_once_is_not_read_again_and_a_bad_one_is_refused_every_time(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The hot path keeps the samplers it checked by their bytes and vocabulary: the same sampler again is
    not read; a bad sampler is never kept (refused on every command); the same bytes checked against
    another vocabulary are checked again; a sampler with per-token data (mask, logit bias) is not kept;
    the cache is bounded."""
    from l4m.scheduler import validation
    from l4m.scheduler.errors import InvalidCommand

    monkeypatch.setattr(validation, "_CHECKED_SAMPLERS", {})
    reads = []
    read = validation._sampler_values
    monkeypatch.setattr(validation, "_sampler_values", lambda sampler: reads.append(sampler.kind) or read(sampler))
    small, large = _model_limits(), _model_limits(50_000)
    top_k = S(kind=3, temperature=0.7, top_k=40)
    for _ in range(3):
        validation.check_forward_text(ft(outputs=[1], samplers=[top_k]).forward_text, small)
    assert reads == [3]  # read (and checked) once
    bad = S(kind=3, temperature=-1.0)
    for _ in range(2):
        with pytest.raises(InvalidCommand, match=r"samplers\[0\]: .*temperature"):
            validation.check_forward_text(ft(outputs=[1], samplers=[bad]).forward_text, small)
    assert reads == [3, 3, 3]
    validation.check_forward_text(ft(outputs=[1], samplers=[top_k]).forward_text, large)
    assert reads == [3, 3, 3, 3]  # another vocabulary: checked again
    # Token 999 is in a 1000-token vocabulary, 1500 is not: a biased sampler is checked on every command.
    biased = S(kind=2, logit_bias_token_ids=[999], logit_bias_values=[1.0])
    validation.check_forward_text(ft(outputs=[1], samplers=[biased]).forward_text, small)
    outside = S(kind=2, logit_bias_token_ids=[1500], logit_bias_values=[1.0])
    with pytest.raises(InvalidCommand, match="1500"):
        validation.check_forward_text(ft(outputs=[1], samplers=[outside]).forward_text, small)
    masked = S(kind=2, vocabulary_mask=common_pb2.Brle(run_lengths=[10, 990]))
    for _ in range(2):
        validation.check_forward_text(ft(outputs=[1], samplers=[masked]).forward_text, small)
    assert reads[-2:] == [2, 2]  # read and checked on every command
    assert len(validation._CHECKED_SAMPLERS) == 2  # top_k under both vocabularies; no biased or masked one
    monkeypatch.setattr(validation, "_MAX_CHECKED_SAMPLERS", 4)
    for temperature in (0.1, 0.2, 0.3, 0.4, 0.5):
        validation.check_forward_text(ft(outputs=[1], samplers=[S(kind=3, temperature=temperature)]).forward_text,
                                      small)
    assert len(validation._CHECKED_SAMPLERS) <= 4
