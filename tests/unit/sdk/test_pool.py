import pytest

from l4m.pool import IdPool


def test_smallest_free_ids_first_and_reuse_after_release() -> None:
    pool = IdPool(capacity=8)
    assert pool.acquire(3) == [0, 1, 2]
    assert pool.release([1]) == [1]
    assert pool.acquire(2) == [1, 3]


def test_shared_ids_are_freed_by_their_last_holder() -> None:
    pool = IdPool(capacity=4)
    ids = pool.acquire(2)
    pool.retain(ids)
    assert pool.refcount(0) == 2
    assert pool.release(ids) == []
    assert pool.release(ids) == [0, 1]
    assert pool.num_in_use == 0


def test_capacity_and_misuse_are_errors() -> None:
    pool = IdPool(capacity=2)
    pool.acquire(2)
    assert not pool.can_acquire(1)
    with pytest.raises(OverflowError, match="free contexts"):
        pool.acquire(1)
    with pytest.raises(KeyError):
        pool.release([5])


def test_quarantined_ids_wait_for_their_stream() -> None:
    pool = IdPool(capacity=8)
    ids = pool.acquire(2)
    assert pool.release(ids, quarantine=1) == [0, 1]
    assert pool.acquire(1, key=2) == [2]  # another stream may not reuse 0 and 1 yet
    assert pool.acquire(1, key=1) == [0]  # the same stream may (its commands run in order)
    pool.unquarantine(1)
    assert pool.acquire(1) == [1]
