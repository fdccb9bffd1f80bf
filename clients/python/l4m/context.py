"""Context: a token sequence and the KV pages that hold it.

A Context owns KV pages (virtual ids from the model's pool) and knows, for every used token slot of
those pages, which token and position it holds. Invariants:

* slots `0 .. num_slots - 1` of the page list are written, in order; the last page holds
  `num_slots - page_size * (len(pages) - 1)` of them (the L4M LENGTH RULE);
* `pending` tokens are known but not fed yet. `fill` only queues; the next decode step feeds every
  pending token in ONE forward_text and reads the output of the last one. After a step the sampled
  token is pending, so a generation always ends with one token not yet in the KV;
* a page another holder can read (shared by `fork`, exported, imported) is never written: before
  writing into such a partial last page, its tokens are moved back to `pending` and recomputed
  (copy-on-write by recomputation, as Pie does), so a fork shares only FULL pages;
* positions continue when pages are dropped (sliding window / attention sink): a dropped page leaves
  the page list, its slots are gone, and the tokens keep their place in `token_ids`.

Every Context has a stream of its own, so forks run side by side (the scheduler batches across
streams). Commands another stream depends on are ordered with `synchronize`: a fork of a context with
commands in flight waits for them before its first command, and `free()` waits for its own stream
before it deallocates anything.

The decode loop (`Generation`, `Token`, `Completion`) is in `l4m.generation`, the window arithmetic in
`l4m.window`. A decode step answers with SDK values (`StepResult`, `SampledToken`, `Distribution`); the
protobuf messages stay inside this module.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from l4m.errors import ContextFreed, L4MError
from l4m.generation import DEFAULT_CONTINUATION_STEPS, Generation
from l4m.sampler import Greedy, Sample, Sampler, TopDistribution
from l4m.stop import AnyOf, MaxTokens, StopCondition, on_tokens
from l4m.v1 import common_pb2, l4m_pb2
from l4m.window import Window, kept_slots, page_visibilities, window_row

if TYPE_CHECKING:
    import numpy as np

    from l4m.constraint import Constraint
    from l4m.model import Model

EXPORT_METADATA_VERSION = 1
GREEDY = Greedy()  # the default sampler


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A token the executor sampled, with its natural-log probability (temperature 1, after the logit bias
    and the mask), and the sampler's `top_logprobs` alternatives: (token id, logprob), most probable first."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Distribution:
    """The top tokens of a next-token distribution, most probable first, with their probabilities."""

    token_ids: tuple[int, ...]
    probabilities: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class StepResult:
    """The answer of a decode step: a `token` (Greedy, Sample) or a `distribution` (TopDistribution)."""

    token: SampledToken | None = None
    distribution: Distribution | None = None


class Context:
    """A token sequence with its KV pages; see the module docstring for the invariants."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._session = model.session
        self._page_size = model.kv_page_size
        self.stream_id = model.streams.acquire(1)[0]
        self._page_ids: list[int] = []
        self._slot_token_ids: list[int] = []
        self._slot_positions: list[int] = []
        self._pending: list[tuple[int, int]] = []  # (token id, position)
        self._token_ids: list[int] = []  # every token of the sequence, pending ones included
        self._next_position = 0
        self._window: Window | None = None
        self._page_visibility: dict[int, np.ndarray] = {}  # page id -> [page_size] bool, when not all visible
        self._wait_before_send: asyncio.Future[Any] | None = None
        self._is_freed = False

    # ---- what it holds -------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """Every token of the sequence (pending ones included, dropped ones too)."""
        return list(self._token_ids)

    @property
    def text(self) -> str:
        return self.model.tokenizer.decode(self._token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return len(self._pending)

    @property
    def num_kv_slots(self) -> int:
        return len(self._slot_token_ids)

    @property
    def kv_page_ids(self) -> list[int]:
        return list(self._page_ids)

    @property
    def kv_last_page_length(self) -> int:
        return self.num_kv_slots - self._page_size * (len(self._page_ids) - 1) if self._page_ids else 0

    @property
    def next_position(self) -> int:
        return self._next_position

    @property
    def window(self) -> Window | None:
        """The window set by `set_window`, or None when every token sees every slot."""
        return self._window

    # ---- feeding -------------------------------------------------------------------------------
    def fill(self, text_or_tokens: str | Sequence[int]) -> None:
        """Queue text or token ids; they are fed with the next forward pass (fast-forward, no sampling)."""
        self._check_alive()
        token_ids = self.model.tokenizer.encode(text_or_tokens) if isinstance(text_or_tokens, str) else text_or_tokens
        for token_id in token_ids:
            if not 0 <= int(token_id) < self.model.vocab_size:
                raise L4MError(f"token id {token_id} is outside the vocabulary (size {self.model.vocab_size})")
            self._pending.append((int(token_id), self._next_position))
            self._token_ids.append(int(token_id))
            self._next_position += 1

    def fill_chat(
        self,
        messages: Sequence[dict[str, object]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, object]] | None = None,
        **template_variables: object,
    ) -> None:
        """Queue a conversation rendered with the model's chat template (`Tokenizer.apply_chat_template`)."""
        self.fill(self.model.tokenizer.apply_chat_template(messages, add_generation_prompt, tools, **template_variables))

    def flush(self) -> None:
        """Feed every pending token but the last (fire-and-forget); the last one waits for a decode step."""
        self._check_alive()
        if self._wait_before_send is not None and not self._wait_before_send.done():
            return  # a fork still waiting for its parent's pages: the next step feeds everything
        self._wait_before_send = None
        if len(self._pending) > 1:
            self._send_pending(len(self._pending) - 1, [], [])

    def set_window(self, num_window_tokens: int, num_sink_tokens: int = 0) -> None:
        """From now on each token sees only the first `num_sink_tokens` and the last `num_window_tokens`
        slots; pages that become fully hidden are deallocated (page usage stays bounded)."""
        if num_window_tokens <= 0 or num_sink_tokens < 0:
            raise ValueError("the window needs num_window_tokens > 0 and num_sink_tokens >= 0")
        self._window = Window(num_window_tokens, num_sink_tokens)

    # ---- decode steps --------------------------------------------------------------------------
    async def step(self, sampler: Sampler = GREEDY, vocabulary_mask: Sequence[int] | None = None,
                   step_index: int = 0) -> StepResult:
        """Feed the pending tokens in one forward pass; the answer for the last of them."""
        self._check_alive()
        if not self._pending:
            raise L4MError(
                "nothing to feed: a decode step needs at least one pending token (fill() some text, or "
                "append the token you chose from the last distribution)"
            )
        (result,) = await self._forward([len(self._pending) - 1], [sampler.to_pb(vocabulary_mask, step_index)])
        return _step_result_from_pb(result)

    async def step_many(self, sampler: Sampler = GREEDY, num_continuation_steps: int = DEFAULT_CONTINUATION_STEPS,
                        stop_token_ids: Iterable[int] = (), step_index: int = 0) -> list[SampledToken]:
        """Feed the pending tokens, then let the executor decode on by itself: it feeds each token it
        samples and samples the next, up to `num_continuation_steps` more times, stopping early at a
        token of `stop_token_ids` (L4M continuation). One round trip for up to 1 + steps tokens, for a
        loop whose next step does not depend on what the controller would see in between.

        Returns the sampled tokens in order. Unlike `step`, they are already in the sequence: every one
        but the last is in the KV, the last is pending (as after `next_token`)."""
        self._check_alive()
        if not self._pending:
            raise L4MError("nothing to feed: step_many needs at least one pending token (fill() some text first)")
        if not isinstance(sampler, (Greedy, Sample)):
            raise L4MError("step_many feeds back the token it samples: use Greedy() or Sample(...), not a distribution")
        if self._window is not None:
            raise L4MError("a Context with a window hides slots per token: it decodes step by step (use step())")
        limit = self.model.max_continuation_steps
        if not 0 <= num_continuation_steps <= limit:
            raise L4MError(f"num_continuation_steps must be in 0..{limit} (the scheduler's max_continuation_steps)")
        if num_continuation_steps == 0:
            token = (await self.step(sampler, None, step_index)).token
            self.fill((token.token_id,))
            return [token]
        await self._wait_dependencies()
        future = self._send_pending(len(self._pending), [len(self._pending) - 1], [sampler.to_pb(None, step_index)],
                                    num_continuation_steps, stop_token_ids)
        assert future is not None
        sampled = [_sampled_token_from_pb(output.token) for output in (await future).forward_text.outputs]
        for token in sampled[:-1]:  # fed by the executor
            self._slot_token_ids.append(token.token_id)
            self._slot_positions.append(self._next_position)
            self._token_ids.append(token.token_id)
            self._next_position += 1
        # Counted as the executor ran them: a pass for each continuation step, a token for each fed one.
        self.model.stats.num_forward_passes += len(sampled) - 1
        self.model.stats.num_forward_tokens += len(sampled) - 1
        # Pages grown for steps that did not run (an early stop) hold nothing: give them back.
        self._truncate_slots(self.num_kv_slots)
        self.fill((sampled[-1].token_id,))
        return sampled

    async def next_token(self, sampler: Sampler = GREEDY) -> tuple[int, float]:
        """One step; appends the sampled token (pending) and returns it with its logprob."""
        result = await self.step(sampler)
        self.fill([result.token.token_id])
        return result.token.token_id, result.token.logprob

    async def next_distribution(self, k: int) -> tuple[list[int], list[float]]:
        """The `k` most probable next tokens and their probabilities. Appends nothing."""
        result = await self.step(TopDistribution(k))
        return list(result.distribution.token_ids), list(result.distribution.probabilities)

    async def logprobs_of(self, token_ids: Sequence[int], top_k: int | None = None) -> list[float]:
        """Log-probability of each of `token_ids` following the sequence; the tokens are appended.

        Exact with the default `top_k` (the whole vocabulary); a smaller `top_k` is cheaper and gives
        -inf for tokens outside the top k.
        """
        self._check_alive()
        if not token_ids:
            return []
        k = top_k or self.model.vocab_size
        start = len(self._pending) - 1
        if start < 0:
            raise L4MError("scoring needs the sequence to have a pending token; fill() the prompt first")
        self.fill(token_ids[:-1])
        outputs = list(range(start, start + len(token_ids)))
        results = await self._forward(outputs, [TopDistribution(k).to_pb()] * len(outputs))
        self.fill(token_ids[-1:])
        import numpy as np

        logprobs = []
        for token_id, result in zip(token_ids, results, strict=True):
            probabilities = dict(zip(result.distribution.token_ids, result.distribution.probabilities, strict=True))
            p = probabilities.get(token_id, 0.0)
            logprobs.append(float(np.log(p)) if p > 0 else float("-inf"))
        return logprobs

    async def verify(self, draft_token_ids: Sequence[int], sampler: Sampler = GREEDY) -> list[int]:
        """Speculative decoding: feed the pending tokens plus a draft in ONE forward pass, keep the longest
        draft prefix the model agrees with, plus the model's own next token; roll back the rest.

        Returns the accepted tokens (at least one: the model's token after the accepted prefix), which
        end up in the sequence, the last of them pending.
        """
        self._check_alive()
        start = len(self._pending) - 1
        if start < 0:
            raise L4MError("verify needs a pending token; fill() the prompt first")
        draft = [int(t) for t in draft_token_ids]
        self.fill(draft)
        outputs = list(range(start, start + len(draft) + 1))
        results = await self._forward(outputs, [sampler.to_pb()] * len(outputs))
        model_tokens = [r.token.token_id for r in results]
        num_accepted = 0
        while num_accepted < len(draft) and draft[num_accepted] == model_tokens[num_accepted]:
            num_accepted += 1
        self.rollback(len(draft) - num_accepted)
        self.fill([model_tokens[num_accepted]])
        return draft[:num_accepted] + [model_tokens[num_accepted]]

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        sampler: Sampler = GREEDY,
        stop: StopCondition | None = None,
        max_tokens: int | None = None,
        constraint: Constraint | None = None,
        max_continuation_steps: int = DEFAULT_CONTINUATION_STEPS,
    ) -> Generation:
        """Generate tokens until `stop` (default: the model's stop tokens) or `max_tokens`.

        `async for token in c.generate(...)` streams `Token`s; `await c.generate(...)` gives the
        `Completion`. With a `constraint`, every step carries its vocabulary mask.

        When nothing but token ids decides the next step (no constraint, no window, a stop condition
        made of token ids and lengths, a Greedy or Sample sampler), the executor decodes up to
        `max_continuation_steps` tokens per round trip by itself after the first token (`step_many`):
        the same tokens, far fewer messages, streamed in bursts. 0 asks for one round trip per token.
        """
        self._check_alive()
        if max_continuation_steps < 0:
            raise ValueError(f"max_continuation_steps must be >= 0 (got {max_continuation_steps})")
        conditions: list[StopCondition] = [stop if stop is not None else on_tokens(self.model.stop_token_ids)]
        if max_tokens is not None:
            conditions.append(MaxTokens(max_tokens))
        return Generation(self, sampler, AnyOf(conditions), constraint, max_continuation_steps)

    async def generate_text(self, sampler: Sampler = GREEDY, stop: StopCondition | None = None,
                            max_tokens: int | None = None, constraint: Constraint | None = None,
                            max_continuation_steps: int = DEFAULT_CONTINUATION_STEPS) -> str:
        return (await self.generate(sampler, stop, max_tokens, constraint, max_continuation_steps)).text

    # ---- backtracking --------------------------------------------------------------------------
    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` tokens (pending ones first, then written slots)."""
        self._check_alive()
        if num_tokens < 0 or num_tokens > len(self._pending) + self.num_kv_slots:
            raise L4MError(
                f"cannot roll back {num_tokens} tokens: {len(self._pending)} pending and {self.num_kv_slots} "
                "in the KV (tokens of dropped pages cannot come back)"
            )
        from_pending = min(num_tokens, len(self._pending))
        del self._pending[len(self._pending) - from_pending:]
        self._truncate_slots(self.num_kv_slots - (num_tokens - from_pending))
        del self._token_ids[len(self._token_ids) - num_tokens:]
        self._next_position -= num_tokens

    # ---- fork, export, import ------------------------------------------------------------------
    def fork(self) -> Context:
        """A new Context with the same tokens. Full pages are shared (copy-on-write); the partial last
        page is recomputed by the child, so neither ever writes into a page the other reads."""
        self._check_alive()
        child = Context(self.model)
        num_full_pages = self.num_kv_slots // self._page_size
        shared = self._page_ids[:num_full_pages]
        self.model.kv_pages.retain(shared)
        num_shared_slots = num_full_pages * self._page_size
        child._page_ids = list(shared)
        child._slot_token_ids = self._slot_token_ids[:num_shared_slots]
        child._slot_positions = self._slot_positions[:num_shared_slots]
        recomputed = list(zip(self._slot_token_ids[num_shared_slots:], self._slot_positions[num_shared_slots:],
                              strict=True))
        child._pending = recomputed + list(self._pending)
        child._token_ids = list(self._token_ids)
        child._next_position = self._next_position
        child._window = self._window
        child._page_visibility = {p: v for p, v in self._page_visibility.items() if p in shared}
        if not self._session.is_stream_synced(self.stream_id):
            # The shared pages may still be in flight on our stream: the child waits for them.
            child._wait_before_send = self._session.send("synchronize", l4m_pb2.SynchronizeCommand(), self.stream_id)
        elif self._wait_before_send is not None:
            child._wait_before_send = self._wait_before_send
        return child

    async def export(self, name: str, persistent: bool = False, is_public: bool = False,
                     num_pages: int | None = None, pinned: bool = False) -> None:
        """Publish this context's pages under `name` (copy-free). Another instance of the same user, or a
        later run with `persistent=True`, continues from here with `Context.import_(model, name)`;
        `is_public=True` lets every user's instances import it. The pages become read-only to every
        holder (this context keeps writing into fresh pages of its own).

        Under memory pressure the scheduler may evict a persistent export (least recently used first, before
        preempting anyone): it is then gone as if unexported, and an import of it raises. `pinned=True`
        (persistent only) keeps it; pinned pages count in the user's quota of persistent export pages.

        `num_pages` publishes only the first `num_pages` pages, which must be full and written (after a
        `flush`): the context's first `num_pages * kv_page_size` slots, as if it had stopped there (how a
        prompt's prefix is shared while its context goes on)."""
        self._check_alive()
        if pinned and not persistent:
            raise ValueError("pinned=True needs persistent=True: a non-persistent export goes with its exporter")
        if num_pages is not None:
            self.flush()
            if not 0 < num_pages * self._page_size <= self.num_kv_slots:
                raise ValueError(f"num_pages: {num_pages} full pages of {self._page_size} slots do not fit the "
                                 f"context's {self.num_kv_slots} written slots")
        # A taken name traps the instance (protocol rule); asking first turns the common case into advice.
        if await self.model.has_export(name):
            raise L4MError(f"an export named {name!r} exists already: pick another name, continue from it "
                           f"with `Context.import_(model, {name!r})`, or remove it first with "
                           f"`model.unexport({name!r})`")
        await self._wait_dependencies()
        self.flush()
        if num_pages is None:
            page_ids = self._page_ids
            metadata = {
                "version": EXPORT_METADATA_VERSION,
                "kv_page_size": self._page_size,
                "slot_token_ids": self._slot_token_ids,
                "slot_positions": self._slot_positions,
                "pending": self._pending,
                "token_ids": self._token_ids,
                "next_position": self._next_position,
                "kv_last_page_length": self.kv_last_page_length,
            }
        else:
            page_ids = self._page_ids[:num_pages]
            metadata = _prefix_metadata(self._page_size, num_pages, self._slot_token_ids, self._slot_positions)
        command = l4m_pb2.ExportKvPagesCommand(
            name=name, kv_page_ids=page_ids, persistent=persistent, metadata=json.dumps(metadata).encode(),
            is_public=is_public, pinned=pinned,
        )
        self._session.send("export_kv_pages", command, self.stream_id)
        self.model.frozen_kv_pages.update(page_ids)

    @classmethod
    async def import_(cls, model: Model, name: str, num_pages: int | None = None) -> Context:
        """A Context continuing from the export `name` (its pages shared read-only). `num_pages` keeps only
        its first `num_pages` pages, which must be full: the context as it was after their last slot (the
        export's slots in the order `fill` writes them, each at the next position; the rest released)."""
        exports = {e.name: e for e in await model.list_exports()}
        if name not in exports:
            raise L4MError(f"no export named {name!r} (exports: {sorted(exports) or 'none'}); export it first")
        if num_pages is not None and not 0 < num_pages <= exports[name].num_kv_pages:
            raise ValueError(f"num_pages: export {name!r} has {exports[name].num_kv_pages} pages, asked for {num_pages}")
        context = cls(model)
        page_ids = model.kv_pages.acquire(exports[name].num_kv_pages)
        # missing_ok: the export may go between the list and the import (unexported, or evicted under memory
        # pressure); that raises below instead of trapping the session.
        command = l4m_pb2.ImportKvPagesCommand(name=name, kv_page_ids=page_ids, missing_ok=True)
        try:
            response = await model.session.request("import_kv_pages", command, context.stream_id)
        except BaseException:
            model.kv_pages.release(page_ids)
            raise
        if response.import_kv_pages.is_missing:  # nothing was mapped: the ids are still free
            model.kv_pages.release(page_ids)
            raise L4MError(f"no export named {name!r}: it went away after it was listed (unexported, or evicted "
                           f"under memory pressure)")
        metadata = json.loads(response.import_kv_pages.metadata or b"{}")
        if metadata.get("version") != EXPORT_METADATA_VERSION or metadata.get("kv_page_size") != model.kv_page_size:
            model.release_kv_pages(page_ids, context.stream_id)
            raise L4MError(f"export {name!r} was not made by this SDK's Context.export (or with another page size)")
        model.frozen_kv_pages.update(page_ids)
        if num_pages is not None and num_pages < len(page_ids):
            if len(metadata["slot_token_ids"]) < num_pages * model.kv_page_size:
                model.release_kv_pages(page_ids, context.stream_id)
                raise L4MError(f"export {name!r}: its first {num_pages} pages are not full")
            model.release_kv_pages(page_ids[num_pages:], context.stream_id)
            page_ids = page_ids[:num_pages]
            metadata = _prefix_metadata(model.kv_page_size, num_pages, metadata["slot_token_ids"],
                                        metadata["slot_positions"])
        context._page_ids = page_ids
        context._slot_token_ids = list(metadata["slot_token_ids"])
        context._slot_positions = list(metadata["slot_positions"])
        context._pending = [tuple(p) for p in metadata["pending"]]
        context._token_ids = list(metadata["token_ids"])
        context._next_position = int(metadata["next_position"])
        return context

    # ---- lifetime ------------------------------------------------------------------------------
    async def free(self) -> None:
        """Release the pages (deallocated when no fork holds them any more) and the stream."""
        if self._is_freed:
            return
        if self._session.failure is None:
            await self._wait_dependencies()
            if not self._session.is_stream_synced(self.stream_id):
                # Another stream may reuse these ids: our queued commands must be done first.
                await self._session.synchronize(self.stream_id)
            if self.model.release_kv_pages(self._page_ids, self.stream_id):
                # Its reply lifts the quarantine of the ids just deallocated (see IdPool).
                done = self._session.send("synchronize", l4m_pb2.SynchronizeCommand(), self.stream_id)
                done.add_done_callback(_ignore_failure)
        self._is_freed = True
        self._page_ids = []
        self.model.streams.release([self.stream_id])

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.free()

    @property
    def is_freed(self) -> bool:
        return self._is_freed

    # ---- internals -----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._is_freed:
            raise ContextFreed(
                "this Context was freed (free() or the end of its `async with`); fork it before freeing "
                "if you need a copy, or keep it alive until you are done with it"
            )
        self._session.check()

    async def _wait_dependencies(self) -> None:
        if self._wait_before_send is not None:
            await self._wait_before_send
            self._wait_before_send = None

    async def _forward(self, output_indices: list[int], samplers: list[common_pb2.SamplerSpec]
                       ) -> list[common_pb2.OutputResult]:
        """Feed ALL pending tokens; answers for `output_indices` (indices into the pending tokens)."""
        await self._wait_dependencies()
        future = self._send_pending(len(self._pending), output_indices, samplers)
        assert future is not None
        response = await future
        return list(response.forward_text.outputs)

    def _send_pending(self, num_tokens: int, output_indices: list[int], samplers: list[common_pb2.SamplerSpec],
                      num_continuation_steps: int = 0, stop_token_ids: Iterable[int] = ()
                      ) -> asyncio.Future[Any] | None:
        """Feed the first `num_tokens` pending tokens in one forward_text (with continuation: the pages
        grown for every step it may run). Fails without changing state."""
        num_recomputed = self._make_tail_writable()
        num_tokens += num_recomputed
        tokens = self._pending[:num_tokens]
        num_context = self.num_kv_slots
        num_slots = num_context + len(tokens) + num_continuation_steps  # the length rule counts continuation
        self._grow_to(num_slots)
        token_ids = [t for t, _ in tokens]
        positions = [p for _, p in tokens]
        item = common_pb2.ForwardTextItem(
            kv_page_ids=self._page_ids,
            kv_last_page_length=self._last_page_length(num_slots),
            token_ids=token_ids,
            position_ids=positions,
            output_indices=[i + num_recomputed for i in output_indices],
            samplers=samplers,
            num_continuation_steps=num_continuation_steps,
            continuation_stop_token_ids=sorted(set(stop_token_ids)),
        )
        if self._window is not None and len(tokens) > 1:
            num_window, num_sink = self._window.num_window_tokens, self._window.num_sink_tokens
            item.attention_masks.extend(
                common_pb2.Brle(run_lengths=window_row(num_context + i, num_window, num_sink))
                for i in range(len(tokens))
            )
        future = self._session.send("forward_text", item, self.stream_id)
        del self._pending[:num_tokens]
        self._slot_token_ids.extend(token_ids)
        self._slot_positions.extend(positions)
        self.model.stats.num_forward_passes += 1
        self.model.stats.num_forward_commands += 1
        self.model.stats.num_forward_tokens += len(tokens)
        if self._window is not None:
            self._apply_window()
        return future

    def _last_page_length(self, num_slots: int) -> int:
        return num_slots - self._page_size * (len(self._page_ids) - 1)

    def _make_tail_writable(self) -> int:
        """Copy-on-write of a shared partial last page: drop it and move its tokens back to pending
        (they are recomputed into a private page). Returns how many tokens moved."""
        num_in_last = self.num_kv_slots % self._page_size
        if num_in_last == 0 or not self.model.is_page_shared(self._page_ids[-1]):
            return 0
        recomputed = list(zip(self._slot_token_ids[-num_in_last:], self._slot_positions[-num_in_last:], strict=True))
        self._truncate_slots(self.num_kv_slots - num_in_last)
        self._pending[:0] = recomputed
        return num_in_last

    def _grow_to(self, num_slots: int) -> None:
        num_pages_needed = -(-num_slots // self._page_size) - len(self._page_ids)
        if num_pages_needed > 0:
            self._page_ids.extend(self.model.allocate_kv_pages(num_pages_needed, self.stream_id))

    def _truncate_slots(self, num_slots: int) -> None:
        num_pages = -(-num_slots // self._page_size)
        released = self._page_ids[num_pages:]
        del self._page_ids[num_pages:]
        del self._slot_token_ids[num_slots:]
        del self._slot_positions[num_slots:]
        for page_id in released:
            self._page_visibility.pop(page_id, None)
        self.model.release_kv_pages(released, self.stream_id)

    def _apply_window(self) -> None:
        """Hide slots outside the window for every later pass; deallocate pages fully hidden."""
        import numpy as np  # lazily: a controller without a window does not pay numpy's import

        from l4m.wire import brle

        assert self._window is not None
        dropped = []
        for index, visible in page_visibilities(len(self._page_ids), self._page_size, self.num_kv_slots,
                                                self._window.num_window_tokens, self._window.num_sink_tokens):
            page_id = self._page_ids[index]
            current = self._page_visibility.get(page_id)
            if (current is not None and np.array_equal(current, visible)) or (current is None and visible.all()):
                continue
            if self.model.is_page_shared(page_id):
                raise L4MError(
                    "a sliding window cannot hide slots of a page shared with a fork or an export; "
                    "set the window before forking or exporting"
                )
            if not visible.any() and index < len(self._page_ids) - 1:
                dropped.append(index)
                continue
            self._page_visibility[page_id] = visible
            item = common_pb2.MaskKvPageItem(kv_page_id=page_id, visibility=common_pb2.Brle(run_lengths=brle.encode(visible)))
            self._session.send("mask_kv_page", item, self.stream_id)
        self._drop_pages(dropped)

    def _drop_pages(self, page_indices: list[int]) -> None:
        if not page_indices:
            return
        keep = kept_slots(self.num_kv_slots, self._page_size, page_indices)
        released = [self._page_ids[i] for i in page_indices]
        self._page_ids = [p for i, p in enumerate(self._page_ids) if i not in set(page_indices)]
        self._slot_token_ids = [t for t, k in zip(self._slot_token_ids, keep, strict=True) if k]
        self._slot_positions = [p for p, k in zip(self._slot_positions, keep, strict=True) if k]
        for page_id in released:
            self._page_visibility.pop(page_id, None)
        self.model.release_kv_pages(released, self.stream_id)


def _ignore_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _step_result_from_pb(result: common_pb2.OutputResult) -> StepResult:
    if result.WhichOneof("result") == "distribution":
        distribution = result.distribution
        return StepResult(distribution=Distribution(tuple(distribution.token_ids), tuple(distribution.probabilities)))
    return StepResult(token=_sampled_token_from_pb(result.token))


def _sampled_token_from_pb(token: common_pb2.SampledToken) -> SampledToken:
    if not token.top_token_ids:
        return SampledToken(token.token_id, token.logprob)
    top = tuple(zip(token.top_token_ids, token.top_logprobs, strict=True))
    return SampledToken(token.token_id, token.logprob, top)


def _prefix_metadata(page_size: int, num_pages: int, slot_token_ids: list[int], slot_positions: list[int]) -> dict:
    """An export's metadata for a context's first `num_pages` full pages: the context as it was after
    their last slot, nothing pending."""
    num_slots = num_pages * page_size
    return {
        "version": EXPORT_METADATA_VERSION,
        "kv_page_size": page_size,
        "slot_token_ids": list(slot_token_ids[:num_slots]),
        "slot_positions": list(slot_positions[:num_slots]),
        "pending": [],
        "token_ids": list(slot_token_ids[:num_slots]),
        "next_position": int(slot_positions[num_slots - 1]) + 1,
        "kv_last_page_length": page_size,
    }
