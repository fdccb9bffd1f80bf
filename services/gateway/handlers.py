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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from l4m.constraint import Constraint
from l4m.model import Model
from l4m.sampler import Greedy, Sample, Sampler
from l4m.stop import Stop, max_tokens, on_strings, on_tokens
from l4m.wire.rules import MAX_SEED

# Choice j of a seeded request samples with seed + j * SEED_STRIDE (its steps add 0, 1, 2, ...).
SEED_STRIDE = 1 << 32

# (choice index, text it adds, the tokens that made it, their logprobs)
OnDelta = Callable[[int, str, list[int], list[float]], None]


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
    ignore_eos: bool = False  # only max_tokens and stop strings end a choice

    def constraint(self, model: Model) -> Constraint | None:
        """A fresh constraint for one choice (it tracks that choice's tokens); raises ConstraintError for a
        schema llguidance rejects."""
        if self.json_schema is None:
            return None
        if self.json_schema is True:
            return Constraint.json_any(model)
        return Constraint.json_schema(model, self.json_schema)

    def sampler(self, choice: int) -> Sampler:
        """Greedy at temperature 0 (OpenAI's "deterministic"), else a draw at it after top-p."""
        if self.temperature == 0:
            return Greedy()
        seed = None if self.seed is None else (self.seed + choice * SEED_STRIDE) % (MAX_SEED + 1)
        return Sample(temperature=self.temperature, top_p=0.0 if self.top_p >= 1 else self.top_p, seed=seed)


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float]  # of each token in `token_ids` (natural log)


def finish_reason(stop: Stop | None) -> str:
    """OpenAI's: "length" when max_tokens ended it, "stop" for a stop token or string or a finished
    `response_format` object."""
    return "length" if stop is None or stop.reason == "length" else "stop"


async def complete(model: Model, prompt_ids: Sequence[int], params: GenerationParams, on_delta: OnDelta | None = None,
                   first_index: int = 0) -> list[Choice]:
    """`params.n` completions of `prompt_ids`, indexed from `first_index`; `on_delta` gets their text as
    it is generated (a stop string is never streamed)."""
    stop = max_tokens(params.max_tokens) if params.ignore_eos else on_tokens(model.stop_token_ids) | max_tokens(
        params.max_tokens)
    if params.stop_strings:
        stop = stop | on_strings(*params.stop_strings)
    async with model.new_context() as root:
        root.fill(list(prompt_ids))
        contexts = [root]
        if params.n > 1:
            root.flush()  # the prompt goes in once; every fork shares its full pages
            contexts += [root.fork() for _ in range(params.n - 1)]
        try:
            return list(await asyncio.gather(*(
                _choice(context, first_index + j, params.sampler(j), stop, params.constraint(model), on_delta)
                for j, context in enumerate(contexts))))
        finally:
            for context in contexts[1:]:
                await context.free()


async def _choice(context, index: int, sampler: Sampler, stop, constraint: Constraint | None,  # type: ignore[no-untyped-def]
                  on_delta: OnDelta | None) -> Choice:
    generation = context.generate(sampler, stop=stop, constraint=constraint)
    if on_delta is None:
        completion = await generation
    else:
        pending: list[int] = []  # tokens whose text is held back (a possible stop string, a split character)
        pending_logprobs: list[float] = []
        async for token in generation:
            pending.append(token.token_id)
            pending_logprobs.append(token.logprob)
            if token.text:
                on_delta(index, token.text, pending, pending_logprobs)
                pending, pending_logprobs = [], []
        if pending:
            on_delta(index, "", pending, pending_logprobs)
        completion = generation.completion
    return Choice(index, completion.text, completion.token_ids, finish_reason(completion.stop), completion.logprobs)
