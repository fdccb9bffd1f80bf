"""Constraints: regex, JSON schema and Lark grammars through `llguidance`, as vocabulary masks.

A `Constraint` follows the generated tokens with an `llguidance.LLMatcher`; before each step it
computes the set of allowed next tokens, sent as a BRLE vocabulary mask (first run allowed) with the
step's sampler. Tokens the grammar forces are fast-forwarded without sampling. `Context.generate`
computes masks in a worker thread (llguidance releases the GIL), so other contexts' steps and the
prompt's forward pass proceed meanwhile.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from l4m.errors import ConstraintError
from l4m.wire import brle

if TYPE_CHECKING:
    import llguidance

    from l4m.model import Model


def ll_tokenizer(model: Model) -> llguidance.LLTokenizer:
    """The llguidance view of the model's tokenizer, built once per tokenizer, vocabulary size and stop tokens
    (it takes ~0.3 s). One tokenizer may serve models whose vocabularies are padded to different sizes
    (`l4m.model.TOKENIZERS` shares it), hence the size in the key."""
    import llguidance

    tokenizer = model.tokenizer
    key = (model.vocab_size, tuple(model.stop_token_ids))
    view = tokenizer.ll_tokenizers.get(key)
    if view is None:
        view = tokenizer.ll_tokenizers[key] = llguidance.LLTokenizer(
            tokenizer.tokenizer_json, n_vocab=model.vocab_size, eos_token=list(model.stop_token_ids) or None
        )
    return view


class Constraint:
    """Allowed next tokens under a grammar; one per generation (it tracks that generation's tokens)."""

    def __init__(self, model: Model, grammar: str, what: str, fix: str = "fix it where the error points") -> None:
        import llguidance

        self._vocab_size = model.vocab_size
        self._what = what
        self._matcher = llguidance.LLMatcher(ll_tokenizer(model), grammar, log_level=0)
        if self._matcher.is_error():
            error = self._matcher.get_error().rstrip()
            raise ConstraintError(f"{what} was rejected by llguidance: {error} -- {fix}")

    @classmethod
    def regex(cls, model: Model, pattern: str) -> Constraint:
        import llguidance

        return cls(model, llguidance.LLMatcher.grammar_from_regex(pattern), f"the regex {pattern!r}",
                   "fix the pattern where the error points (Rust regex syntax: no look-around, no back-references)")

    @classmethod
    def json_schema(cls, model: Model, schema: dict[str, Any] | str, whitespace_flexible: bool = False) -> Constraint:
        """JSON that validates against `schema`. Compact (`{"a": 1, "b": 2}`) unless `whitespace_flexible`:
        free whitespace lets a small model wander into endless blank lines."""
        import llguidance

        options = {"whitespace_flexible": whitespace_flexible, "item_separator": ", ", "key_separator": ": "}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as error:
            raise ConstraintError(f"the JSON schema is not valid JSON: {error}; pass a dict or a JSON string") from error
        return cls(model, grammar, "the JSON schema",
                   "fix the schema where the error points, or leave out a keyword llguidance does not support")

    @classmethod
    def json_any(cls, model: Model) -> Constraint:
        """Any JSON object."""
        return cls.json_schema(model, json.dumps({"type": "object"}))

    @classmethod
    def lark(cls, model: Model, grammar: str) -> Constraint:
        import llguidance

        return cls(model, llguidance.LLMatcher.grammar_from_lark(grammar), "the Lark grammar",
                   "fix the grammar where the error points (llguidance's Lark dialect)")

    def mask(self) -> list[int]:
        """BRLE of the tokens allowed next (first run allowed), `vocab_size` values long."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.zeros(self._vocab_size, dtype=bool)
        num = min(self._vocab_size, bits.size)
        allowed[:num] = bits[:num].astype(bool)
        if not allowed.any():
            raise ConstraintError(f"{self._what} allows no next token ({self._matcher.get_error() or 'dead end'})")
        return brle.encode(allowed)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces now (fed without sampling)."""
        return list(self._matcher.compute_ff_tokens())

    def consume(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ConstraintError(f"token {token_id} does not fit {self._what}: {self._matcher.get_error()}")

    def is_finished(self) -> bool:
        """True when the grammar accepts no more tokens (only the stop token could follow)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()
