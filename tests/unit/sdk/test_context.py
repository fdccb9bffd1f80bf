"""Context page math and semantics against the fake backend (which checks the L4M rules)."""

from __future__ import annotations

import json

import pytest

from l4m import stop
from l4m.context import Context
from l4m.drafter import NgramDrafter, generate_speculative
from l4m.errors import ContextFreed, L4MError, Trapped
from l4m.fake import FakeL4M
from l4m.sampler import Sample
from l4m.search import beam_search
from l4m.v1 import l4m_pb2
from tests.unit.sdk.sdk_reference import greedy_reference, logprob_reference

PROMPT = list(range(10, 20))  # 10 tokens: 2 full pages of 4 and a partial one


def _commands(fake: FakeL4M, kind: str) -> list:
    return [getattr(c, kind) for c in fake.commands if c.WhichOneof("command") == kind]


def test_fill_is_lazy_and_one_step_feeds_everything_across_pages(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        assert fake.commands == [] and c.num_pending_tokens == 10
        token, _ = await c.next_token()
        assert token == greedy_reference(fake, PROMPT, 1)[0]
        (forward,) = _commands(fake, "forward_text")
        assert list(forward.token_ids) == PROMPT and list(forward.position_ids) == list(range(10))
        assert len(forward.kv_page_ids) == 3 and forward.kv_last_page_length == 2
        assert list(forward.output_indices) == [9]
        assert c.num_kv_slots == 10 and c.num_pending_tokens == 1 and c.token_ids == PROMPT + [token]

    run(body())


def test_greedy_generation_matches_the_model(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        completion = await c.generate(max_tokens=12, stop=stop.on_tokens([]))
        assert completion.token_ids == greedy_reference(fake, PROMPT, 12)
        assert completion.stop == stop.Stop("length")
        assert completion.text == model.tokenizer.decode(completion.token_ids)

    run(body())


def test_streamed_tokens_add_up_to_the_completion(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill("Hello")
        generation = c.generate(sampler=Sample(temperature=0.9, seed=3), max_tokens=8, stop=stop.on_tokens([]))
        streamed = "".join([t.text async for t in generation])
        assert streamed == generation.completion.text and len(generation.completion.token_ids) == 8

    run(body())


def test_stop_string_is_cut_from_the_text(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        reference = model.tokenizer.decode(greedy_reference(fake, PROMPT, 20))
        marker = reference[5:7]
        completion = await c.generate(stop=stop.on_strings(marker), max_tokens=20)
        assert completion.stop.reason == "string"
        assert completion.text == reference[: reference.index(marker)]

    run(body())


def test_fork_shares_full_pages_and_recomputes_the_partial_one(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        parent = model.new_context()
        parent.fill(PROMPT)
        await parent.next_token()  # 10 slots written: pages 4 + 4 + 2
        child = parent.fork()
        assert child.kv_page_ids == parent.kv_page_ids[:2]
        assert all(model.kv_pages.refcount(p) == 2 for p in child.kv_page_ids)
        assert child.num_pending_tokens == 3  # 2 recomputed + the pending one
        expected = greedy_reference(fake, PROMPT, 7)
        a = await parent.generate(max_tokens=6, stop=stop.on_tokens([]))
        b = await child.generate(max_tokens=6, stop=stop.on_tokens([]))
        assert a.token_ids == b.token_ids == expected[1:]
        assert set(parent.kv_page_ids).isdisjoint(child.kv_page_ids[2:])
        await parent.free()
        await child.free()
        await model.session.synchronize()
        assert fake.num_pages_in_use == 0 and model.kv_pages.num_in_use == 0

    run(body())


def test_forks_diverge_independently(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        base = model.new_context()
        base.fill(PROMPT)
        forks = [base.fork() for _ in range(3)]
        for i, fork in enumerate(forks):
            fork.fill([100 + i])
        results = [await f.generate(max_tokens=5, stop=stop.on_tokens([])) for f in forks]
        for i, result in enumerate(results):
            assert result.token_ids == greedy_reference(fake, PROMPT + [100 + i], 5)

    run(body())


def test_rollback_then_continue(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        await c.generate(max_tokens=6, stop=stop.on_tokens([]))
        c.rollback(9)  # the 6 generated (one pending) and 3 prompt tokens
        assert c.token_ids == PROMPT[:7] and c.num_kv_slots == 7 and c.next_position == 7
        c.fill([42])
        completion = await c.generate(max_tokens=4, stop=stop.on_tokens([]))
        assert completion.token_ids == greedy_reference(fake, PROMPT[:7] + [42], 4)
        with pytest.raises(L4MError, match="cannot roll back"):
            c.rollback(100)

    run(body())


def test_rollback_into_a_shared_page_recomputes_it(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        parent = model.new_context()
        parent.fill(PROMPT[:8])
        await parent.next_token()  # pages 4 + 4 full, shared after the fork
        child = parent.fork()
        parent.rollback(3)  # back into the shared second page
        parent.fill([77])
        got = await parent.generate(max_tokens=3, stop=stop.on_tokens([]))
        assert got.token_ids == greedy_reference(fake, PROMPT[:6] + [77], 3)
        child_got = await child.generate(max_tokens=3, stop=stop.on_tokens([]))
        assert child_got.token_ids == greedy_reference(fake, PROMPT[:8], 4)[1:]

    run(body())


def test_window_drops_pages_and_keeps_usage_bounded(run, open_model) -> None:
    fake = FakeL4M(kv_page_size=4)

    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.set_window(num_window_tokens=6, num_sink_tokens=2)
        c.fill(PROMPT)
        peak = 0
        completion = Context  # placeholder for the type checker
        generation = c.generate(max_tokens=40, stop=stop.on_tokens([]))
        async for _ in generation:
            peak = max(peak, fake.num_pages_in_use)
        completion = generation.completion
        assert completion.token_ids == greedy_reference(fake, PROMPT, 40, window=6, num_sink=2)
        assert peak <= 5  # sink page + window (6 slots over up to 3 pages) + the page being filled
        assert c.next_position == 50 and c.num_kv_slots < 20
        assert any(c.WhichOneof("command") == "mask_kv_page" for c in fake.commands)

    run(body())


def test_freed_context_and_capacity_errors_say_what_to_do(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        await c.next_token()
        await c.free()
        await c.free()  # idempotent
        await model.session.synchronize()
        assert fake.num_pages_in_use == 0
        with pytest.raises(ContextFreed, match="fork it before freeing"):
            c.fill([1])
        async with model.new_context() as scoped:
            scoped.fill([1, 2])
        with pytest.raises(ContextFreed):
            await scoped.next_token()

    run(body())


def test_more_pages_than_an_instance_may_hold_is_refused_before_sending(run, open_model) -> None:
    fake = FakeL4M(kv_page_size=4, num_kv_pages=3)

    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(list(range(20)))
        with pytest.raises(L4MError, match="free contexts you no longer need"):
            await c.next_token()
        assert c.num_pending_tokens == 20 and fake.commands == []  # nothing lost, nothing sent
        c.rollback(12)
        await c.next_token()

    run(body())


def test_running_out_of_cluster_pages_is_a_trap_with_advice(run, open_model) -> None:
    fake = FakeL4M(kv_page_size=4, num_kv_pages=3, max_kv_pages_per_instance=100)

    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(list(range(20)))
        with pytest.raises(Trapped, match="free contexts you no longer need") as info:
            await c.next_token()
        assert info.value.kind == l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED
        with pytest.raises(Trapped):
            model.new_context().fill([1])

    run(body())


def test_export_then_import_skips_the_prefill(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        first = await open_model(fake)
        c = first.new_context()
        c.fill(PROMPT)
        await c.export("prefix", persistent=True)
        await first.session.close()  # the export outlives its exporter
        second = await open_model(fake)
        before = fake.stats.num_forward_tokens
        imported = await Context.import_(second, "prefix")
        assert imported.token_ids == PROMPT and imported.num_pending_tokens == 1
        completion = await imported.generate(max_tokens=5, stop=stop.on_tokens([]))
        assert completion.token_ids == greedy_reference(fake, PROMPT, 5)
        # Fed after the import: the pending token, the recomputed partial page (1 slot), the generated ones.
        assert fake.stats.num_forward_tokens - before == 1 + 1 + 4
        with pytest.raises(L4MError, match="no export named"):
            await Context.import_(second, "missing")

    run(body())


def test_an_export_may_be_pinned_only_when_persistent_and_an_import_may_find_it_gone(run, open_model,
                                                                                        fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        with pytest.raises(ValueError, match="pinned=True needs persistent=True"):
            await c.export("pinned", pinned=True)
        await c.export("pinned", persistent=True, pinned=True)
        await model.session.synchronize(c.stream_id)
        assert [(e.name, e.pinned) for e in _commands(fake, "export_kv_pages")] == [("pinned", True)]
        listed = await model.list_exports()
        assert [(e.name, e.pinned) for e in listed] == [("pinned", True)]
        model.unexport("pinned")  # gone after the list (as an eviction under memory pressure would do)
        model.list_exports = lambda: _listed(listed)  # type: ignore[method-assign]
        with pytest.raises(L4MError, match="went away after it was listed"):
            await Context.import_(model, "pinned")
        assert _commands(fake, "import_kv_pages")[-1].missing_ok
        fresh = model.new_context()
        fresh.fill(PROMPT)
        token, _ = await fresh.next_token()  # the session goes on
        assert token >= 0 and model.session.failure is None

    run(body())


async def _listed(exports: list) -> list:
    return exports


def test_logprobs_of_candidates(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        logprobs = await c.logprobs_of([5, 6, 7])
        expected = [logprob_reference(fake, PROMPT + [5, 6, 7][:i], t) for i, t in enumerate([5, 6, 7])]
        assert logprobs == pytest.approx(expected, abs=1e-4)
        assert c.token_ids == PROMPT + [5, 6, 7]

    run(body())


def test_beam_search_sorted_and_scored(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        beams = await beam_search(c, beam_width=3, max_tokens=4, stop_token_ids=[])
        scores = [b.logprob for b in beams]
        assert len(beams) == 3 and scores == sorted(scores, reverse=True)
        best = beams[0]
        expected = sum(logprob_reference(fake, PROMPT + list(best.token_ids[:i]), t) for i, t in enumerate(best.token_ids))
        assert best.logprob == pytest.approx(expected, abs=1e-3)
        assert c.token_ids == PROMPT  # the searched context is untouched
        await c.free()
        await model.session.synchronize()
        assert fake.num_pages_in_use == 0

    run(body())


def test_speculative_decoding_is_exactly_greedy_with_fewer_passes(run, open_model) -> None:
    fake = FakeL4M(kv_page_size=4, context="unigram")

    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        passes_before = model.stats.num_forward_passes
        completion = await generate_speculative(c, NgramDrafter(n=3), max_tokens=60, stop_token_ids=[])
        passes = model.stats.num_forward_passes - passes_before
        assert completion.token_ids == greedy_reference(fake, PROMPT, 60)
        assert passes < 40

    run(body())


def test_debug_stats(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        await c.next_token()
        assert json.loads(await model.debug_query("stats"))["forward_tokens"] == 10

    run(body())
