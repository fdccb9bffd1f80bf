"""Per-user token quotas: one token bucket per user, shared by all the user's instances.

A bucket holds at most the user's tokens-per-minute quota and refills continuously at quota/60 tokens
per second, so a user may burst up to one minute's quota and then feeds at the quota's rate. A bucket
that has refilled completely is the same as a new one, so once its user has no instance left it is
dropped: the tables hold only users with instances or that fed recently, however many come and go.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from l4m.scheduler.errors import TokenBudgetExceeded

if TYPE_CHECKING:
    from l4m.scheduler.instances import Instance


class TokenBucket:
    __slots__ = ("capacity", "level", "updated_at")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.updated_at = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated_at) * self.capacity / 60.0)
        self.updated_at = now

    @property
    def is_full(self) -> bool:
        return self.level >= self.capacity


class UserQuotas:
    """Tokens per minute per user. Each registration brings its user's quota (the latest applies; 0 is
    unlimited); the quota is forgotten with the user's last instance, its bucket once it has refilled
    (so ending every instance and launching again does not reset an emptied bucket)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._num_instances: dict[str, int] = {}
        self._quotas: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}

    def num_entries(self) -> int:
        """Users held in any table (0 once every instance is gone and every bucket refilled)."""
        return len(self._num_instances) + len(self._quotas) + len(self._buckets)

    def add_instance(self, user: str, tokens_per_minute: int) -> None:
        self._num_instances[user] = self._num_instances.get(user, 0) + 1
        if tokens_per_minute:
            self._quotas[user] = tokens_per_minute
        else:
            self._quotas.pop(user, None)
            self._buckets.pop(user, None)

    def remove_instance(self, user: str) -> None:
        num_left = self._num_instances.get(user, 0) - 1
        if num_left > 0:
            self._num_instances[user] = num_left
            return
        self._num_instances.pop(user, None)
        self._quotas.pop(user, None)
        self._drop_full_buckets()

    def check(self, user: str, num_tokens: int) -> None:
        """Raises TokenBudgetExceeded when `user` cannot feed `num_tokens` now."""
        bucket = self._bucket(user)
        if bucket is not None and num_tokens > bucket.level:
            raise TokenBudgetExceeded(f"user {user} exceeded its quota of {bucket.capacity} tokens per minute")

    def spend(self, user: str, num_tokens: int) -> None:
        """Takes `num_tokens` (after `check`)."""
        bucket = self._bucket(user)
        if bucket is not None:
            bucket.level -= num_tokens

    def _bucket(self, user: str) -> TokenBucket | None:
        quota = self._quotas.get(user)
        if quota is None:
            return None
        now = self._clock()
        bucket = self._buckets.get(user)
        if bucket is None:
            bucket = self._buckets[user] = TokenBucket(quota, now)
        bucket.capacity = quota
        bucket.refill(now)
        return bucket

    def _drop_full_buckets(self) -> None:
        now = self._clock()
        for user, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.is_full and user not in self._quotas:
                del self._buckets[user]


def spend_tokens(quotas: UserQuotas, instance: Instance, num_tokens: int) -> None:
    """Charge the instance, each ancestor and the user; all or nothing. The trap names whose budget ran out."""
    payers = (instance, *instance.ancestors()) if instance.parent is not None else (instance,)
    for payer in payers:
        used = payer.num_tokens_used + num_tokens
        if payer.max_tokens and used > payer.max_tokens:
            whose = "the instance's" if payer is instance else f"its ancestor {payer.instance_id!r}'s"
            raise TokenBudgetExceeded(
                f"feeding {num_tokens} more tokens would use {used} of {whose} budget of {payer.max_tokens}"
            )
    quotas.check(instance.user, num_tokens)
    for payer in payers:
        payer.num_tokens_used += num_tokens
    quotas.spend(instance.user, num_tokens)
