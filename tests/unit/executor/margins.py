"""The margin rule for an opt-in rounding (x in bf16, a float16 KV cache), as for the bf16 dtype
(test_forward.py): teacher-forced on the engine's own tokens, every step where the float32 reference's top-2
margin is at least `margin` must pick the reference's argmax, and the logits stay within `max_diff` of it."""

from __future__ import annotations

import torch

from l4m.executor.engine import Engine
from l4m.executor.weights import LoadedModel
from tests.unit.executor.conftest import LogitsRecorder, PageTables
from tests.unit.executor.reference import reference_logits


class RecordedRun:
    """forward_text batches of named sequences on one engine, keeping each sequence's logits rows (the
    prompt's, then one per step) and the token sampled last in each batch."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tables = PageTables(engine)
        self.recorder = LogitsRecorder(engine)
        self.tokens: dict[str, list[int]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}

    def run(self, items: list[tuple[str, list[int]]]) -> None:
        """One batch: (name, tokens to feed) per item."""
        before = len(self.recorder.calls)
        results = self.engine.forward_text([self.tables.item(name, feed) for name, feed in items])
        rows = torch.cat(self.recorder.calls[before:])
        at = 0
        for (name, feed), result in zip(items, results, strict=True):
            self.logits.setdefault(name, []).append(rows[at : at + len(feed)])
            self.tokens.setdefault(name, []).append(result.outputs[-1].token_id)
            at += len(feed)

    def last(self, name: str) -> list[int]:
        return self.tokens[name][-1:]


def margin_rule_failures(run: RecordedRun, loaded: LoadedModel, prompts: list[list[int]], names: list[str],
                         margin: float, max_diff: float, label: str) -> list[int]:
    """The indices of the sequences `names` (fed `prompts[i]` first) outside the rule; prints what each
    measured."""
    failures = []
    for i, name in enumerate(names):
        prompt, got_tokens = prompts[i], run.tokens[name]
        ref = reference_logits(loaded, prompt + got_tokens[:-1])
        got = torch.cat(run.logits[name])  # the prompt's rows, then one per step
        assert got.shape == ref.shape
        diff = float((got - ref).abs().max())
        top2 = ref[len(prompt) - 1 :].topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        ref_tokens = ref[len(prompt) - 1 :].argmax(-1).tolist()
        flips = [(s, round(m, 3)) for s, (a, b, m) in enumerate(zip(got_tokens, ref_tokens, margins, strict=True))
                 if a != b]
        print(f"{label}, prompt {i} ({len(got_tokens)} steps): max |Δlogit| {diff:.4f}; "
              f"steps where it differs from the float32 argmax (step, float32 margin): {flips}")
        if any(m >= margin for _, m in flips) or diff >= max_diff:
            failures.append(i)
    return failures
