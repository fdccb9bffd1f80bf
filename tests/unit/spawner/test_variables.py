"""Shared variables: versions, compare-and-set without lost updates, append, watch, limits."""

from __future__ import annotations

import asyncio

import pytest

from l4m.spawner.variables import VariableError, VariableStore


def run(coro):
    return asyncio.run(coro)


def test_missing_variable_has_version_zero() -> None:
    snap = VariableStore().get("x")
    assert (snap.exists, snap.value, snap.version) == (False, b"", 0)


def test_every_write_increments_the_version() -> None:
    async def go() -> None:
        store = VariableStore()
        assert (await store.set("x", b"a")).version == 1
        assert (await store.set("x", b"b")).version == 2
        assert (await store.append("x", b"c")).value == b"bc"
        assert store.get("x").version == 3

    run(go())


def test_compare_and_set_refuses_a_stale_version() -> None:
    async def go() -> None:
        store = VariableStore()
        created = await store.compare_and_set("x", 0, b"first")
        assert created.swapped and created.snapshot.version == 1
        stale = await store.compare_and_set("x", 0, b"second")
        assert not stale.swapped and stale.snapshot.value == b"first"
        fresh = await store.compare_and_set("x", 1, b"second")
        assert fresh.swapped and store.get("x").value == b"second"

    run(go())


def test_concurrent_increments_by_compare_and_set_lose_nothing() -> None:
    async def worker(store: VariableStore, times: int) -> None:
        done = 0
        while done < times:
            snap = store.get("counter")
            await asyncio.sleep(0)  # let the others interleave between read and write
            new = str(int(snap.value or b"0") + 1).encode()
            if (await store.compare_and_set("counter", snap.version, new)).swapped:
                done += 1

    async def go() -> None:
        store = VariableStore()
        await asyncio.gather(*(worker(store, 25) for _ in range(20)))
        assert store.get("counter").value == b"500"

    run(go())


def test_watch_sees_current_value_then_every_change() -> None:
    async def go() -> None:
        store = VariableStore()
        await store.set("x", b"0")
        seen: list[bytes] = []

        async def watcher() -> None:
            async for snap in store.watch("x"):
                seen.append(snap.value)
                if len(seen) == 3:
                    return

        task = asyncio.create_task(watcher())
        await asyncio.sleep(0)
        await store.set("x", b"1")
        await asyncio.sleep(0)
        await store.set("x", b"2")
        await asyncio.wait_for(task, 1)
        assert seen == [b"0", b"1", b"2"]

    run(go())


def test_bad_names_and_sizes_are_refused() -> None:
    async def go() -> None:
        store = VariableStore(max_total_bytes=10)
        with pytest.raises(VariableError, match="1..256 bytes"):
            await store.set("", b"x")
        with pytest.raises(VariableError, match="would exceed 10 bytes"):
            await store.set("x", b"x" * 11)
        assert store.get("x").exists is False

    run(go())
