"""Sandbox uids: one per live instance, from a range no other spawner on the host holds (`UidPool`)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from l4m.spawner.process_sandbox import UidPool
from l4m.spawner.sandbox import SandboxError


def test_uids_are_unique_while_held_and_reused_after(tmp_path: Path) -> None:
    pool = UidPool(100_000, 2, tmp_path)
    first, second = pool.acquire(), pool.acquire()
    assert {first, second} == {100_000, 100_001}
    pool.release(first)
    assert pool.acquire() == first


def test_two_uid_pools_on_one_host_never_share_a_uid(tmp_path: Path) -> None:
    first = UidPool(100_000, 2_000, tmp_path)
    second = UidPool(100_000, 2_000, tmp_path)  # another cluster's spawner, same defaults
    third = UidPool(101_000, 500, tmp_path)  # overlaps the first range: moves past both held ranges
    small = [UidPool(100_000, 2, tmp_path) for _ in range(2)]  # a range smaller than a chunk moves a chunk
    assert [p.first_uid for p in small] == [105_000, 106_000]
    ranges = [set(range(p.first_uid, p.first_uid + n)) for p, n in ((first, 2_000), (second, 2_000), (third, 500))]
    assert ranges[0].isdisjoint(ranges[1]) and ranges[0].isdisjoint(ranges[2]) and ranges[1].isdisjoint(ranges[2])
    assert (first.first_uid, second.first_uid) == (100_000, 102_000)
    assert first.acquire() == 100_000 and second.acquire() == 102_000
    del first  # a spawner that ends (or crashes) gives its range back
    gc.collect()
    assert UidPool(100_000, 2_000, tmp_path).first_uid == 100_000


def test_a_host_with_every_uid_range_held_refuses_with_a_reason(tmp_path: Path) -> None:
    held = [UidPool(100_000, 1_000, tmp_path, max_moves=2) for _ in range(3)]
    with pytest.raises(SandboxError, match="no free range of 1000 sandbox uids from 100000 on: 3 ranges are held"):
        UidPool(100_000, 1_000, tmp_path, max_moves=2)
    assert [p.first_uid for p in held] == [100_000, 101_000, 102_000]
