"""Exported and imported pages are read-only to every holder (the fake mirrors the scheduler's rule), and
the SDK never writes into them: exporter and importer both keep generating, each into pages of its own."""

from __future__ import annotations

import pytest

from l4m import stop
from l4m.context import Context
from l4m.errors import Trapped
from l4m.fake import FakeL4M
from l4m.v1 import common_pb2, l4m_pb2
from tests.unit.sdk.sdk_reference import greedy_reference

PROMPT = [5, 6, 7, 8, 9, 10, 11]  # 7 tokens: a partial last page of 4-slot pages


def test_exporter_and_importer_both_continue_from_shared_pages(run, open_model, fake: FakeL4M) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        exporter = await open_model(fake)
        c = exporter.new_context()
        c.fill(PROMPT)
        await c.export("prefix", is_public=True)
        await exporter.session.request("synchronize", l4m_pb2.SynchronizeCommand(), c.stream_id)
        importer = await open_model(fake)
        imported = await Context.import_(importer, "prefix")
        [info] = await importer.list_exports()
        assert info.is_public
        ours = await c.generate(max_tokens=4, stop=stop.on_tokens([]))
        theirs = await imported.generate(max_tokens=4, stop=stop.on_tokens([]))
        assert ours.token_ids == theirs.token_ids == greedy_reference(fake, PROMPT, 4)

    run(body())


@pytest.mark.parametrize("write", ["forward_text", "mask_kv_page", "copy_kv_page"])
def test_a_raw_write_into_an_imported_page_traps_with_the_fix(run, open_model, fake: FakeL4M, write: str) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        exporter = await open_model(fake)
        c = exporter.new_context()
        c.fill(PROMPT)
        await c.export("prefix")
        await exporter.session.request("synchronize", l4m_pb2.SynchronizeCommand(), c.stream_id)
        importer = await open_model(fake)
        imported = await Context.import_(importer, "prefix")
        last = imported._page_ids[-1]
        commands = {
            "forward_text": common_pb2.ForwardTextItem(kv_page_ids=imported._page_ids, kv_last_page_length=4,
                                                       token_ids=[1], position_ids=[7]),
            "mask_kv_page": common_pb2.MaskKvPageItem(kv_page_id=last, visibility=common_pb2.Brle(run_lengths=[0, 4])),
            "copy_kv_page": common_pb2.CopyKvPageItem(source_kv_page_id=imported._page_ids[0],
                                                      destination_kv_page_id=last, length_tokens=1),
        }
        importer.session.send(write, commands[write])
        with pytest.raises(Trapped) as trapped:
            await importer.session.request("synchronize", l4m_pb2.SynchronizeCommand())
        assert f"kv page {last} is shared by an export (read-only): copy_kv_page it into a page you own first" in str(trapped.value)
        assert await c.generate(max_tokens=2, stop=stop.on_tokens([]))  # the exporter is unaffected

    run(body())
