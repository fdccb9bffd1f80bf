"""Shared variables: versions, compare-and-set without lost updates, append, watch, limits, cost."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from l4m.spawner.variables import (
    DEFAULT_MAX_TOTAL_BYTES,
    VARIABLE_OVERHEAD_BYTES,
    VariableError,
    VariableQuotaExceeded,
    VariableStore,
)


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


def test_every_variable_costs_its_name_and_a_fixed_overhead() -> None:
    async def go() -> None:
        store = VariableStore(max_total_bytes=1000)
        await store.set("ab", b"")
        assert store.total_bytes == 2 + VARIABLE_OVERHEAD_BYTES
        await store.set("ab", b"xyz")
        assert store.total_bytes == 5 + VARIABLE_OVERHEAD_BYTES
        await store.append("ab", b"!")
        assert (store.total_bytes, store.num_variables) == (6 + VARIABLE_OVERHEAD_BYTES, 1)

    run(go())


def test_empty_variables_under_long_names_hit_the_quota_and_stay_bounded() -> None:
    """The attack of issue #17: 145,600 empty variables with 250-byte names cost 253 MB. Now each costs
    its name plus VARIABLE_OVERHEAD_BYTES, so the default 64 MiB total admits about 132,000."""

    async def go() -> tuple[int, int]:
        store = VariableStore()
        tracemalloc.start()
        try:
            for i in range(200_000):
                await store.set(f"{i:0250d}", b"")
        except VariableQuotaExceeded as error:
            assert "would exceed 67108864 bytes" in str(error)
        else:
            raise AssertionError("200,000 empty variables fit the quota")
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return store.num_variables, held

    num_variables, held = run(go())
    assert num_variables == DEFAULT_MAX_TOTAL_BYTES // (250 + VARIABLE_OVERHEAD_BYTES)
    per_variable = held / num_variables
    print(f"{num_variables} variables hold {held / 2**20:.1f} MiB: {per_variable:.0f} bytes each")
    # What they really take stays near what they are charged (name + overhead).
    assert per_variable <= 1.5 * (250 + VARIABLE_OVERHEAD_BYTES)


def test_watching_a_missing_name_stores_nothing_after_the_watch() -> None:
    async def go() -> None:
        store = VariableStore()
        watches = [store.watch(f"v{i}") for i in range(100)]
        for watch in watches:
            assert not (await anext(watch)).exists
        for watch in watches:
            await watch.aclose()
        assert (store._vars, store.total_bytes) == ({}, 0)

    run(go())


def test_clear_drops_everything() -> None:
    async def go() -> None:
        store = VariableStore()
        await store.set("x", b"1")
        store.clear()
        assert (store.get("x").exists, store.total_bytes, store.num_variables) == (False, 0, 0)

    run(go())
