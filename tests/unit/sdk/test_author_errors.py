"""The mistakes a controller author makes get an error that says what happened and what to do."""

from __future__ import annotations

import pytest

from l4m.constraint import Constraint
from l4m.context import Context
from l4m.errors import ConstraintError, ContextFreed, L4MError, Trapped
from l4m.fake import FakeL4M
from l4m.v1 import l4m_pb2
from tests.unit.sdk.test_context import PROMPT


def test_a_freed_fork_says_to_fork_before_freeing_and_the_parent_lives_on(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        parent = model.new_context()
        parent.fill(PROMPT)
        await parent.next_token()
        async with parent.fork() as child:
            await child.next_token()
        with pytest.raises(ContextFreed, match="fork it before freeing"):
            child.fill([1])
        with pytest.raises(ContextFreed, match="fork it before freeing"):
            await child.generate(max_tokens=2)
        with pytest.raises(ContextFreed, match="fork it before freeing"):
            child.fork()
        await parent.next_token()  # the pages the fork shared are still the parent's
        await parent.free()
        with pytest.raises(ContextFreed, match="keep it alive until you are done"):
            parent.fork()

    run(body())


def test_a_fork_outlives_its_freed_parent(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        parent = model.new_context()
        parent.fill(PROMPT)
        await parent.next_token()
        child = parent.fork()
        await parent.free()
        completion = await child.generate(max_tokens=3)
        assert len(completion.token_ids) == 3
        await child.free()
        await model.session.synchronize()
        assert fake.num_pages_in_use == 0

    run(body())


def test_a_bad_schema_regex_or_grammar_says_how_to_fix_it(run, open_model, smollm_fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(smollm_fake)
        with pytest.raises(ConstraintError, match=r"Invalid type: no-such-type -- fix the schema where the error"):
            Constraint.json_schema(model, {"type": "object", "properties": {"a": {"type": "no-such-type"}}})
        with pytest.raises(ConstraintError, match="not valid JSON.*pass a dict or a JSON string"):
            Constraint.json_schema(model, '{"type": "object",')
        with pytest.raises(ConstraintError, match=r"(?s)look-around.*-- fix the pattern .*no look-around"):
            Constraint.regex(model, "a(?=b)")
        with pytest.raises(ConstraintError, match=r"(?s)unknown name.*-- fix the grammar"):
            Constraint.lark(model, "start: foo")

    run(body())


def test_exporting_under_a_taken_name_says_what_to_do_and_traps_nothing(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        first = model.new_context()
        first.fill(PROMPT)
        await first.export("prefix", persistent=True)
        second = model.new_context()
        second.fill(PROMPT)
        with pytest.raises(L4MError, match=r"'prefix' exists already: pick another name.*model.unexport\('prefix'\)"):
            await second.export("prefix")
        await second.next_token()  # the session is not trapped
        imported = await Context.import_(model, "prefix")
        assert imported.token_ids == PROMPT

    run(body())


def test_importing_a_missing_export_says_to_export_it_first(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        with pytest.raises(L4MError, match="no export named 'prefix' .*export it first"):
            await Context.import_(model, "prefix")

    run(body())


def test_a_window_on_shared_pages_says_to_set_it_before_forking(run, open_model, fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(fake)
        parent = model.new_context()
        parent.fill(PROMPT)
        await parent.next_token()
        child = parent.fork()
        child.set_window(num_window_tokens=4, num_sink_tokens=1)
        child.fill([1, 2, 3])
        with pytest.raises(L4MError, match="set the window before forking or exporting"):
            await child.next_token()

    run(body())


@pytest.mark.parametrize("kind", [k for k in l4m_pb2.TrapKind.values() if k != l4m_pb2.TRAP_KIND_UNSPECIFIED])
def test_every_trap_kind_comes_with_advice(kind: int) -> None:
    message = str(Trapped(kind, "the scheduler's reason"))
    assert message.startswith(f"instance trapped ({l4m_pb2.TrapKind.Name(kind)}): the scheduler's reason -- ")
    assert "the session is over" not in message  # the fallback for a kind nobody wrote advice for
