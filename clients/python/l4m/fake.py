"""An in-process L4M backend for tests: the command semantics of the scheduler + executor on a tiny
deterministic "model", behind the same stub interface as `L4MServiceStub` (`GetInfo`, `Session`).

Controller authors can unit-test their programs with it (`FakeL4M().session()`), and the SDK's own
unit tests run against it with no socket. It checks what the real services check -- the LENGTH RULE,
the MASK RULE, ownership of ids, page capacity, read-only exported pages -- and traps the session the
same way. Every session is one user here: each sees and may unexport every export (the scheduler
keeps users apart; see ExportKvPagesCommand).

The "model": every KV slot stores the (token, position) written there; the logits after a token are a
pseudo-random vector seeded by the (token, position) pairs that token can see (its causal slots, minus
masked ones), so any mistake in pages, positions or masks changes the output. With
`context="unigram"` (or "bigram") only the last visible token (or two) counts, which makes greedy text
cycle (an n-gram drafter then has something to find).
"""

from __future__ import annotations

import asyncio
import functools
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from l4m.v1 import common_pb2, l4m_pb2
from l4m.wire import brle, limits, rules

SMOLLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# SmolLM2's, whose first ids the tiny vocabulary copies: bos <|im_start|> (1), eos <|im_end|> (2).
SMOLLM_CHAT_TEMPLATE_VARIABLES = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def tiny_tokenizer_json() -> str:
    """A byte-level tokenizer without merges: 3 special tokens, then one token per byte (vocab 259)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda c: _byte_of_char(c))
    vocab = {t: i for i, t in enumerate(TINY_SPECIAL_TOKENS)}
    vocab.update({c: len(TINY_SPECIAL_TOKENS) + i for i, c in enumerate(byte_chars)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    return tokenizer.to_str()


def _byte_of_char(char: str) -> int:
    # GPT-2's byte->unicode table: printable bytes map to themselves, the rest to 256 + n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


class FakeTrap(Exception):
    def __init__(self, kind: int, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _invalid(reason: str) -> FakeTrap:
    return FakeTrap(l4m_pb2.TRAP_KIND_INVALID_COMMAND, reason)


# `with _obeys(where):` a broken rule of the protocol (`l4m.wire.rules`, the scheduler's own) as an
# INVALID_COMMAND trap naming `where`.
_obeys = functools.partial(rules.reported_as, _invalid)


_MAX_CONTEXT_TOKENS = 8192


@dataclass
class _Page:
    slots: list[tuple[int, int] | None]
    visible: np.ndarray
    num_holders: int = 1
    is_frozen: bool = False  # exported: read-only to every holder until freed (as in the scheduler)


@dataclass
class _Export:
    physical_ids: list[int]
    metadata: bytes
    persistent: bool
    owner: int
    is_public: bool = False
    pinned: bool = False  # reported only: the fake never evicts


@dataclass
class FakeStats:
    num_forward_passes: int = 0
    num_forward_tokens: int = 0
    num_sessions: int = 0
    num_get_info: int = 0
    per_session_forward_tokens: dict[int, int] = field(default_factory=dict)


class FakeL4M:
    """The backend. `stub()` gives the object a `Session` talks to."""

    def __init__(
        self,
        tokenizer_json: str | None = None,
        vocab_size: int | None = None,
        kv_page_size: int = 4,
        num_kv_pages: int = 256,
        max_kv_pages_per_instance: int | None = None,
        stop_token_ids: Sequence[int] = (2,),
        stop_bias: float = 0.0,
        context: str = "full",
        chat_template: str = SMOLLM_CHAT_TEMPLATE,
        special_token_ids: dict[str, int] | None = None,
        chat_template_variables: dict[str, str] | None = None,
        logit_scale: float = 3.0,
        max_continuation_steps: int = 64,
    ) -> None:
        self.tokenizer_json = tokenizer_json or tiny_tokenizer_json()
        if vocab_size is None:
            from tokenizers import Tokenizer

            vocab_size = Tokenizer.from_str(self.tokenizer_json).get_vocab_size(with_added_tokens=True)
        self.vocab_size = vocab_size
        self.kv_page_size = kv_page_size
        self.num_kv_pages = num_kv_pages
        self.max_kv_pages_per_instance = max_kv_pages_per_instance or num_kv_pages
        self.stop_token_ids = tuple(stop_token_ids)
        self.stop_bias = stop_bias
        self.context = context
        self.chat_template = chat_template
        self.special_token_ids = special_token_ids or {t: i for i, t in enumerate(TINY_SPECIAL_TOKENS)}
        self.chat_template_variables = (
            SMOLLM_CHAT_TEMPLATE_VARIABLES if chat_template_variables is None else chat_template_variables
        )
        self.logit_scale = logit_scale
        self.max_continuation_steps = max_continuation_steps
        self.pages: dict[int, _Page] = {}
        self._free_physical = list(range(num_kv_pages - 1, -1, -1))
        self.exports: dict[str, _Export] = {}
        self.stats = FakeStats()
        self.commands: list[l4m_pb2.SessionRequest] = []  # every command received, for assertions

    # ---- stub interface --------------------------------------------------------------------------
    def stub(self) -> FakeL4M:
        return self

    async def GetInfo(self, request: l4m_pb2.GetInfoRequest, timeout: float | None = None,
                      metadata: Any = None) -> l4m_pb2.GetInfoResponse:  # noqa: N802 (gRPC's name)
        return self.get_info_blocking(request, timeout, metadata)

    def get_info_blocking(self, request: l4m_pb2.GetInfoRequest, timeout: float | None = None,
                          metadata: Any = None) -> l4m_pb2.GetInfoResponse:
        """GetInfo for `Session(..., blocking_get_info=fake.get_info_blocking)`."""
        self.stats.num_get_info += 1
        info = self.info()
        if request.omit_tokenizer_json:
            info.model.ClearField("tokenizer_json")
        return info

    def Session(self, metadata: Any = None) -> FakeCall:  # noqa: N802 (gRPC's name)
        self.stats.num_sessions += 1
        return FakeCall(self, self.stats.num_sessions)

    def info(self) -> l4m_pb2.GetInfoResponse:
        model = common_pb2.ModelInfo(
            name="fake-tiny", architecture="fake", vocab_size=self.vocab_size, num_layers=1, hidden_size=8,
            num_attention_heads=1, num_kv_heads=1, head_dim=8, max_context_tokens=_MAX_CONTEXT_TOKENS,
            tokenizer_json=self.tokenizer_json, chat_template=self.chat_template,
            stop_token_ids=self.stop_token_ids, special_token_ids=self.special_token_ids, capabilities=["text"],
            chat_template_variables=self.chat_template_variables, tokenizer_sha256=rules.tokenizer_digest(self.tokenizer_json),
        )
        return l4m_pb2.GetInfoResponse(
            protocol_version="l4m.v1", model=model, kv_page_size=self.kv_page_size,
            max_kv_pages_per_instance=self.max_kv_pages_per_instance, max_embed_slots_per_instance=0,
            num_free_kv_pages=len(self._free_physical), num_executors=1,
            max_continuation_steps=self.max_continuation_steps,
            max_distribution_entries_per_command=limits.DEFAULT_MAX_DISTRIBUTION_ENTRIES_PER_COMMAND,
            max_command_bytes=limits.MAX_COMMAND_BYTES,
            max_response_bytes=limits.MAX_RESPONSE_BYTES,
            max_mask_runs_per_command=limits.DEFAULT_MAX_MASK_RUNS_PER_COMMAND,
            model_names=["fake-tiny"],
        )

    @property
    def num_pages_in_use(self) -> int:
        return len(self.pages)

    # ---- the model -------------------------------------------------------------------------------
    def logits(self, visible: Sequence[tuple[int, int]]) -> np.ndarray:
        """Deterministic logits given the visible (token, position) pairs, in slot order."""
        window = {"unigram": 1, "bigram": 2}.get(self.context)
        key = [t for t, _ in visible[-window:]] if window else [v for pair in visible for v in pair]
        seed = zlib.crc32(np.asarray(key, dtype=np.int64).tobytes())
        logits = np.random.default_rng(seed).standard_normal(self.vocab_size) * self.logit_scale
        for stop_id in self.stop_token_ids:
            logits[stop_id] += self.stop_bias
        return logits

    # ---- physical pages --------------------------------------------------------------------------
    def _new_page(self) -> int:
        if not self._free_physical:
            raise FakeTrap(l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED, "no free KV page left")
        physical = self._free_physical.pop()
        self.pages[physical] = _Page([None] * self.kv_page_size, np.ones(self.kv_page_size, dtype=bool))
        return physical

    def _release_page(self, physical: int) -> None:
        page = self.pages[physical]
        page.num_holders -= 1
        if page.num_holders == 0:
            del self.pages[physical]
            self._free_physical.append(physical)


class FakeCall:
    """One session: the `grpc.aio` stream-stream call interface (`write`, `read`, `done_writing`, `cancel`)."""

    def __init__(self, backend: FakeL4M, session_number: int) -> None:
        self._backend = backend
        self._number = session_number
        self._responses: asyncio.Queue[Any] = asyncio.Queue()
        self._kv: dict[int, int] = {}  # virtual -> physical
        self._is_done = False

    async def write(self, request: l4m_pb2.SessionRequest) -> None:
        if self._is_done:
            raise asyncio.InvalidStateError("the session has ended")
        self._backend.commands.append(request)
        await asyncio.sleep(0)  # let other sessions interleave, as a real stream would
        try:
            response = self._execute(request)
        except FakeTrap as trap:
            self._end(l4m_pb2.SessionResponse(
                stream_id=request.stream_id, request_id=request.request_id,
                trap=l4m_pb2.Trap(kind=trap.kind, reason=trap.reason, offending_request_id=request.request_id),
            ))
            return
        if response is not None:
            response.stream_id = request.stream_id
            response.request_id = request.request_id
            self._responses.put_nowait(response)

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()  # the fake accepts every session at once

    async def read(self) -> Any:
        return await self._responses.get()

    async def done_writing(self) -> None:
        self._end(None)

    def cancel(self) -> bool:
        self._end(None)
        return True

    def _end(self, last: l4m_pb2.SessionResponse | None) -> None:
        if self._is_done:
            return
        self._is_done = True
        if last is not None:
            self._responses.put_nowait(last)
        for physical in self._kv.values():
            self._backend._release_page(physical)
        self._kv.clear()
        for name in [n for n, e in self._backend.exports.items() if e.owner == self._number and not e.persistent]:
            self._drop_export(name)
        self._responses.put_nowait(grpc.aio.EOF)

    # ---- commands --------------------------------------------------------------------------------
    def _execute(self, request: l4m_pb2.SessionRequest) -> l4m_pb2.SessionResponse | None:
        command = request.WhichOneof("command")
        handler = getattr(self, f"_do_{command}", None)
        if handler is None:
            raise FakeTrap(l4m_pb2.TRAP_KIND_UNSUPPORTED, f"the fake backend does not implement {command}")
        return handler(getattr(request, command))

    def _physical(self, virtual: int, field_name: str) -> int:
        if virtual not in self._kv:
            raise _invalid(f"{field_name}: KV page {virtual} is not allocated by this instance")
        return self._kv[virtual]

    def _writable(self, virtual: int, field_name: str) -> _Page:
        page = self._backend.pages[self._physical(virtual, field_name)]
        if page.is_frozen:
            raise _invalid(f"{field_name}: kv page {virtual} is shared by an export (read-only): copy_kv_page it "
                           f"into a page you own first")
        return page

    def _do_get_info(self, command: l4m_pb2.GetInfoCommand) -> l4m_pb2.SessionResponse:
        return l4m_pb2.SessionResponse(info=self._backend.info())

    def _do_allocate(self, item: common_pb2.AllocateItem) -> None:
        if item.kind != common_pb2.RESOURCE_KIND_KV_PAGE:
            raise FakeTrap(l4m_pb2.TRAP_KIND_UNSUPPORTED, "the fake backend has no embedding slots")
        if len(self._kv) + len(item.ids) > self._backend.max_kv_pages_per_instance:
            raise FakeTrap(l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED,
                           f"allocate: {len(self._kv) + len(item.ids)} KV pages exceed the per-instance limit")
        for virtual in item.ids:
            if virtual in self._kv:
                raise _invalid(f"allocate.ids: KV page {virtual} is already in use")
            self._kv[virtual] = self._backend._new_page()

    def _do_deallocate(self, item: common_pb2.DeallocateItem) -> None:
        for virtual in item.ids:
            self._backend._release_page(self._physical(virtual, "deallocate.ids"))
            del self._kv[virtual]

    def _do_forward_text(self, item: common_pb2.ForwardTextItem) -> l4m_pb2.SessionResponse | None:
        backend, page_size = self._backend, self._backend.kv_page_size
        num_tokens = len(item.token_ids)
        num_steps = item.num_continuation_steps
        with _obeys("forward_text"):
            rules.check_continuation_steps(num_steps, backend.max_continuation_steps)
            num_context = rules.check_forward_text(
                kv_page_ids=item.kv_page_ids, kv_last_page_length=item.kv_last_page_length, token_ids=item.token_ids,
                position_ids=item.position_ids, attention_masks=[row.run_lengths for row in item.attention_masks],
                output_indices=item.output_indices, num_samplers=len(item.samplers), num_continuation_steps=num_steps,
                vocab_size=backend.vocab_size, max_context=_MAX_CONTEXT_TOKENS, page_size=page_size,
                max_pages=backend.max_kv_pages_per_instance)
        for index, spec in enumerate(item.samplers):
            with _obeys(f"forward_text samplers[{index}]"):
                rules.check_sampler(
                    spec.kind, distribution_top_k=spec.distribution_top_k, temperature=spec.temperature,
                    top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p, seed=None,
                    vocabulary_mask=spec.vocabulary_mask.run_lengths, vocab_size=backend.vocab_size,
                    logit_bias_token_ids=spec.logit_bias_token_ids, logit_bias_values=spec.logit_bias_values,
                    top_logprobs=spec.top_logprobs)
        if num_steps or item.continuation_stop_token_ids:
            with _obeys("forward_text"):
                first = item.samplers[0] if item.samplers else None
                rules.check_continuation(
                    num_steps=num_steps, stop_token_ids=item.continuation_stop_token_ids, num_tokens=num_tokens,
                    output_indices=item.output_indices, num_mask_rows=len(item.attention_masks),
                    sampler_kind=first.kind if first is not None else None,
                    has_vocabulary_mask=first is not None and len(first.vocabulary_mask.run_lengths) > 0,
                    last_position=item.position_ids[-1], vocab_size=backend.vocab_size,
                    max_context=_MAX_CONTEXT_TOKENS, max_steps=backend.max_continuation_steps)
        pages = [backend.pages[self._physical(v, "forward_text.kv_page_ids")] for v in item.kv_page_ids]
        for index in range(num_context // page_size, len(pages)):  # the pages the new slots land in
            self._writable(item.kv_page_ids[index], "forward_text.kv_page_ids")
        for i, (token, position) in enumerate(zip(item.token_ids, item.position_ids, strict=True)):
            slot = num_context + i
            pages[slot // page_size].slots[slot % page_size] = (token, position)
        backend.stats.num_forward_passes += 1
        backend.stats.num_forward_tokens += num_tokens
        per_session = backend.stats.per_session_forward_tokens
        per_session[self._number] = per_session.get(self._number, 0) + num_tokens
        if not item.output_indices:
            return None
        outputs = []
        for index, spec in zip(item.output_indices, item.samplers, strict=True):
            row = None
            if item.attention_masks:
                row = brle.decode(item.attention_masks[index].run_lengths)
            visible = self._visible(pages, num_context + index + 1, row)
            outputs.append(self._sample(backend.logits(visible), spec))
        self._continue(item, pages, num_context + num_tokens, outputs)
        return l4m_pb2.SessionResponse(forward_text=common_pb2.ForwardTextResult(outputs=outputs))

    def _visible(self, pages: list[_Page], num_slots: int, row: np.ndarray | None) -> list[tuple[int, int]]:
        page_size = self._backend.kv_page_size
        visible = []
        for slot in range(num_slots):
            page = pages[slot // page_size]
            if page.visible[slot % page_size] and (row is None or row[slot]):
                if page.slots[slot % page_size] is None:
                    raise _invalid(f"forward_text: slot {slot} is read before it was written")
                visible.append(page.slots[slot % page_size])
        return visible

    def _continue(self, item: common_pb2.ForwardTextItem, pages: list[_Page], next_slot: int,
                  outputs: list[common_pb2.OutputResult]) -> None:
        """Continuation: feed each sampled token back and sample again (see ForwardTextItem)."""
        backend, page_size = self._backend, self._backend.kv_page_size
        stops = set(item.continuation_stop_token_ids)
        for step in range(1, item.num_continuation_steps + 1):
            token = outputs[-1].token.token_id
            if token in stops:
                return
            slot = next_slot + step - 1
            pages[slot // page_size].slots[slot % page_size] = (token, item.position_ids[-1] + step)
            backend.stats.num_forward_passes += 1
            backend.stats.num_forward_tokens += 1
            spec = common_pb2.SamplerSpec()
            spec.CopyFrom(item.samplers[0])
            if spec.HasField("seed"):
                spec.seed = rules.step_seed(spec.seed, step)
            outputs.append(self._sample(backend.logits(self._visible(pages, slot + 1, None)), spec))

    def _sample(self, logits: np.ndarray, spec: common_pb2.SamplerSpec) -> common_pb2.OutputResult:
        if spec.logit_bias_token_ids:  # added before anything else, as on the executor
            logits = logits.astype(np.float64, copy=True)
            logits[list(spec.logit_bias_token_ids)] += np.asarray(spec.logit_bias_values, dtype=np.float64)
        if spec.vocabulary_mask.run_lengths:  # its shape obeys the rules (checked when the command came)
            allowed = brle.decode(spec.vocabulary_mask.run_lengths)
            logits = np.where(allowed, logits, -np.inf)
        logprobs = logits - np.logaddexp.reduce(logits)
        if spec.kind == common_pb2.SAMPLER_KIND_DISTRIBUTION:
            order = np.argsort(-logprobs, kind="stable")[: spec.distribution_top_k]
            return common_pb2.OutputResult(distribution=common_pb2.Distribution(
                token_ids=order.tolist(), probabilities=np.exp(logprobs[order]).tolist()))
        if spec.kind == common_pb2.SAMPLER_KIND_GREEDY:
            token = int(np.argmax(logprobs))
        elif spec.kind == common_pb2.SAMPLER_KIND_SAMPLE:
            token = _draw(logits, spec)
        else:  # checked when the command came
            raise AssertionError(f"sampler kind {spec.kind}")
        top = np.argsort(-logprobs, kind="stable")[: spec.top_logprobs]
        return common_pb2.OutputResult(token=common_pb2.SampledToken(
            token_id=token, logprob=float(logprobs[token]), top_token_ids=top.tolist(),
            top_logprobs=logprobs[top].tolist()))

    def _do_mask_kv_page(self, item: common_pb2.MaskKvPageItem) -> None:
        with _obeys("mask_kv_page"):
            rules.check_page_visibility(item.visibility.run_lengths, self._backend.kv_page_size)
        visibility = brle.decode(item.visibility.run_lengths)
        self._writable(item.kv_page_id, "mask_kv_page.kv_page_id").visible = visibility

    def _do_copy_kv_page(self, item: common_pb2.CopyKvPageItem) -> None:
        with _obeys("copy_kv_page"):
            rules.check_copy(item.source_offset_tokens, item.destination_offset_tokens, item.length_tokens,
                             self._backend.kv_page_size)
        source = self._backend.pages[self._physical(item.source_kv_page_id, "copy_kv_page.source_kv_page_id")]
        target = self._writable(item.destination_kv_page_id, "copy_kv_page.destination")
        n = item.length_tokens
        target.slots[item.destination_offset_tokens:item.destination_offset_tokens + n] = \
            source.slots[item.source_offset_tokens:item.source_offset_tokens + n]

    def _do_export_kv_pages(self, command: l4m_pb2.ExportKvPagesCommand) -> None:
        if command.name in self._backend.exports:
            raise _invalid(f"export_kv_pages.name: {command.name!r} is taken")
        if command.pinned and not command.persistent:
            raise _invalid(f"export_kv_pages.pinned: export {command.name!r}: pinned applies to persistent exports only")
        physical = [self._physical(v, "export_kv_pages.kv_page_ids") for v in command.kv_page_ids]
        for p in physical:
            self._backend.pages[p].num_holders += 1
            self._backend.pages[p].is_frozen = True
        self._backend.exports[command.name] = _Export(physical, command.metadata, command.persistent, self._number,
                                                      command.is_public, command.pinned)

    def _do_unexport_kv_pages(self, command: l4m_pb2.UnexportKvPagesCommand) -> None:
        if command.name not in self._backend.exports and command.missing_ok:
            return
        if command.name not in self._backend.exports:
            raise _invalid(f"unexport_kv_pages.name: no export {command.name!r}")
        self._drop_export(command.name)

    def _drop_export(self, name: str) -> None:
        for p in self._backend.exports.pop(name).physical_ids:
            self._backend._release_page(p)

    def _do_import_kv_pages(self, command: l4m_pb2.ImportKvPagesCommand) -> l4m_pb2.SessionResponse:
        export = self._backend.exports.get(command.name)
        if export is None and command.missing_ok:  # as the scheduler: nothing mapped, no trap
            return l4m_pb2.SessionResponse(import_kv_pages=l4m_pb2.ImportKvPagesResult(is_missing=True))
        if export is None:
            raise _invalid(f"import_kv_pages.name: no export {command.name!r}")
        if len(command.kv_page_ids) != len(export.physical_ids):
            raise _invalid("import_kv_pages.kv_page_ids: one id per exported page")
        for virtual, physical in zip(command.kv_page_ids, export.physical_ids, strict=True):
            if virtual in self._kv:
                raise _invalid(f"import_kv_pages.kv_page_ids: {virtual} is already in use")
            self._kv[virtual] = physical
            self._backend.pages[physical].num_holders += 1
        return l4m_pb2.SessionResponse(import_kv_pages=l4m_pb2.ImportKvPagesResult(
            num_kv_pages=len(export.physical_ids), metadata=export.metadata))

    def _do_list_exports(self, command: l4m_pb2.ListExportsCommand) -> l4m_pb2.SessionResponse:
        exports = [l4m_pb2.ExportInfo(name=n, num_kv_pages=len(e.physical_ids), persistent=e.persistent,
                                      metadata_bytes=len(e.metadata), is_public=e.is_public, pinned=e.pinned)
                   for n, e in self._backend.exports.items()]
        return l4m_pb2.SessionResponse(list_exports=l4m_pb2.ListExportsResult(exports=exports))

    def _do_synchronize(self, command: l4m_pb2.SynchronizeCommand) -> l4m_pb2.SessionResponse:
        return l4m_pb2.SessionResponse(synchronize=l4m_pb2.SynchronizeDone())

    def _do_set_stream_priority(self, command: l4m_pb2.SetStreamPriorityCommand) -> None:
        return None

    def _do_debug_query(self, command: l4m_pb2.DebugQueryCommand) -> l4m_pb2.SessionResponse:
        stats = self._backend.stats
        answers = {
            "ping": "pong",
            "stats": json.dumps({"forward_passes": stats.num_forward_passes, "forward_tokens": stats.num_forward_tokens,
                                 "kv_pages_in_use": self._backend.num_pages_in_use}),
        }
        if command.query not in answers:
            raise _invalid(f"debug_query.query: unknown query {command.query!r}")
        return l4m_pb2.SessionResponse(debug_query=l4m_pb2.DebugQueryResult(response=answers[command.query]))


def _draw(logits: np.ndarray, spec: common_pb2.SamplerSpec) -> int:
    scaled = logits / spec.temperature
    probabilities = np.exp(scaled - np.logaddexp.reduce(scaled))
    order = np.argsort(-probabilities, kind="stable")
    keep = np.ones(order.size, dtype=bool)
    if spec.top_k:
        keep[spec.top_k:] = False
    if 0 < spec.top_p < 1:
        cumulative = np.cumsum(probabilities[order])
        keep &= np.concatenate(([True], cumulative[:-1] < spec.top_p))
    if spec.min_p:
        keep &= probabilities[order] >= spec.min_p * probabilities[order[0]]
    candidates = order[keep]
    weights = probabilities[candidates] / probabilities[candidates].sum()
    rng = np.random.default_rng(spec.seed if spec.HasField("seed") else None)
    return int(rng.choice(candidates, p=weights))
