"""The built-in handlers: a completion of a prompt, written against the controller SDK like any controller.

They run inside the gateway process as L4M sessions, not in a sandbox: they are the gateway's own
trusted code, and a sandboxed controller per request would add a process start (tens of ms warm,
~50 MiB each) to every request for nothing the scheduler does not already enforce (the session speaks
for an instance of the caller's user, with its quotas).

`n` choices share the prompt: it is fed once, then forked (full pages shared, docs/controllers.md), and
the choices generate side by side, batched together by the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from l4m.constraint import Constraint
from l4m.context import Context
from l4m.errors import L4MError
from l4m.gateway.prefix_cache import PrefixScope
from l4m.model import Model
from l4m.sampler import Greedy, Sample, Sampler
from l4m.stop import Stop, max_tokens, on_strings, on_tokens
from l4m.wire.rules import MAX_SEED

log = logging.getLogger("l4m.gateway")

# Choice j of a seeded request samples with seed + j * SEED_STRIDE (its steps add 0, 1, 2, ...).
SEED_STRIDE = 1 << 32

# (choice index, text it adds, the tokens that made it, their logprobs, each one's top_logprobs alternatives
# as (token id, logprob) pairs: empty lists when the request asked for none)
OnDelta = Callable[[int, str, list[int], list[float], list[tuple[tuple[int, float], ...]]], None]


@dataclass(frozen=True)
class GenerationParams:
    n: int
    max_tokens: int
    stop_strings: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # The output's JSON schema (`response_format`): True for any JSON object, None for free text.
    json_schema: dict | bool | None = None
    grammar: str | None = None  # an llguidance Lark grammar the output follows instead (tools.py)
    ignore_eos: bool = False  # only max_tokens and stop strings end a choice
    # OpenAI's logit_bias ((token id, bias), ...), penalties and top_logprobs (l4m.sampler's fields).
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0

    def constraint(self, model: Model) -> Constraint | None:
        """A fresh constraint for one choice (it tracks that choice's tokens); raises ConstraintError for a
        schema llguidance rejects."""
        if self.grammar is not None:
            return Constraint.lark(model, self.grammar)
        if self.json_schema is None:
            return None
        if self.json_schema is True:
            return Constraint.json_any(model)
        return Constraint.json_schema(model, self.json_schema)

    def sampler(self, choice: int) -> Sampler:
        """Greedy at temperature 0 (OpenAI's "deterministic"), else a draw at it after top-p; either after
        the logit bias and penalties, returning the top_logprobs alternatives."""
        shaping = {"logit_bias": self.logit_bias, "presence_penalty": self.presence_penalty,
                   "frequency_penalty": self.frequency_penalty, "top_logprobs": self.top_logprobs}
        if self.temperature == 0:
            return Greedy(**shaping)  # type: ignore[arg-type]
        seed = None if self.seed is None else (self.seed + choice * SEED_STRIDE) % (MAX_SEED + 1)
        return Sample(temperature=self.temperature, top_p=0.0 if self.top_p >= 1 else self.top_p, seed=seed,
                      **shaping)  # type: ignore[arg-type]


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float]  # of each token in `token_ids` (natural log)
    cached_tokens: int = 0  # of its prompt, reused from the prefix cache
    # Per token, its top_logprobs alternatives ((token id, logprob), ...); empty when none were asked for.
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)


def finish_reason(stop: Stop | None) -> str:
    """OpenAI's: "length" when max_tokens ended it, "stop" for a stop token or string or a finished
    `response_format` object."""
    return "length" if stop is None or stop.reason == "length" else "stop"


async def complete(model: Model, prompt_ids: Sequence[int], params: GenerationParams, on_delta: OnDelta | None = None,
                   first_index: int = 0, prefixes: PrefixScope | None = None) -> list[Choice]:
    """`params.n` completions of `prompt_ids`, indexed from `first_index`; `on_delta` gets their text as
    it is generated (a stop string is never streamed). With `prefixes`, the prompt starts from its
    longest cached prefix and publishes its own full pages once answered (prefix_cache.py)."""
    stop = max_tokens(params.max_tokens) if params.ignore_eos else on_tokens(model.stop_token_ids) | max_tokens(
        params.max_tokens)
    if params.stop_strings:
        stop = stop | on_strings(*params.stop_strings)
    keys = prefixes.keys(prompt_ids, model.kv_page_size) if prefixes is not None else []
    root, num_cached_pages = await _start(model, prompt_ids, prefixes, keys)
    num_cached = num_cached_pages * model.kv_page_size
    async with root:
        root.fill(list(prompt_ids[num_cached:]))
        contexts = [root]
        if params.n > 1:
            root.flush()  # the prompt goes in once; every fork shares its full pages
            contexts += [root.fork() for _ in range(params.n - 1)]
        try:
            choices = list(await asyncio.gather(*(
                _choice(context, first_index + j, params.sampler(j), stop, params.constraint(model), on_delta)
                for j, context in enumerate(contexts))))
        finally:
            for context in contexts[1:]:
                await context.free()
        if prefixes is not None:
            await prefixes.publish(root, keys, num_cached_pages)
    for choice in choices:
        choice.cached_tokens = num_cached
    return choices


async def _start(model: Model, prompt_ids: Sequence[int], prefixes: PrefixScope | None,
                 keys: list[bytes]) -> tuple[Context, int]:
    """A context holding the prompt's longest cached prefix (and how many pages that is), else an empty one."""
    match = prefixes.cache.lookup(keys, len(prompt_ids), model.kv_page_size) if prefixes is not None else None
    if match is None:
        return model.new_context(), 0
    try:
        return await Context.import_(model, match.name, num_pages=match.num_pages), match.num_pages
    except L4MError as error:  # its export is gone (unexported behind the cache's back)
        log.warning("prefix cache: %s; feeding the whole prompt", error)
        prefixes.cache.forget(match)  # type: ignore[union-attr]
        return model.new_context(), 0
    finally:
        prefixes.cache.release(match)  # type: ignore[union-attr]


async def _choice(context, index: int, sampler: Sampler, stop, constraint: Constraint | None,  # type: ignore[no-untyped-def]
                  on_delta: OnDelta | None) -> Choice:
    generation = context.generate(sampler, stop=stop, constraint=constraint)
    if on_delta is None:
        completion = await generation
    else:
        pending: list[int] = []  # tokens whose text is held back (a possible stop string, a split character)
        pending_logprobs: list[float] = []
        pending_tops: list[tuple[tuple[int, float], ...]] = []
        async for token in generation:
            pending.append(token.token_id)
            pending_logprobs.append(token.logprob)
            pending_tops.append(token.top_logprobs)
            if token.text:
                on_delta(index, token.text, pending, pending_logprobs, pending_tops)
                pending, pending_logprobs, pending_tops = [], [], []
        if pending:
            on_delta(index, "", pending, pending_logprobs, pending_tops)
        completion = generation.completion
    return Choice(index, completion.text, completion.token_ids, finish_reason(completion.stop), completion.logprobs,
                  top_logprobs=completion.top_logprobs)
