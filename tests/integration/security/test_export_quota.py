"""A user's persistent exports outlive its instances, so they are capped per user
(`--max-export-pages-per-user`, default half of the executor's pages): alice's controller allocates
pages and exports them persistent until its next export would pass the quota, which traps
`TRAP_KIND_RESOURCE_EXHAUSTED` naming it; the exports stay after it ended, and another user's launch
still gets pages and the same greedy tokens. Alice then unexports them (the suite's last test checks
every page is back)."""

from __future__ import annotations

import json

from tests.integration.harness import UpCluster
from tests.integration.security.conftest import (
    CONTROLLERS,
    Baseline,
    Users,
    greedy_completion,
    pages_used,
    wait_until,
)

HOARDER = CONTROLLERS / "hoarder.py"
PREFIX = "quota-hoard"


def test_persistent_exports_stop_at_the_users_quota_and_others_still_get_pages(
        l4m_up: UpCluster, users: Users, baseline: Baseline) -> None:
    hoarded = users.alice.run(HOARDER, "hoard", PREFIX)
    try:
        assert hoarded.reason == "EXIT_REASON_TRAPPED", hoarded.describe()
        assert any("(TRAP_KIND_RESOURCE_EXHAUSTED)" in line for line in hoarded.logs), hoarded.describe()
        assert "--max-export-pages-per-user" in hoarded.exit.message, hoarded.describe()  # type: ignore[union-attr]
        last = json.loads(hoarded.messages[-1])
        quota = int(hoarded.exit.message.split("quota of ")[1].split()[0])  # type: ignore[union-attr]
        # Every export up to the quota went through; the one that would pass it trapped.
        assert last["exported"] <= quota < last["exported"] + last["chunk"], (last, quota)
        # The executor zeroes each page it allocates: it catches up with the scheduler's count shortly after.
        wait_until(lambda: (held := pages_used(l4m_up))["scheduler_kv_pages"] == held["executor_kv_pages"], timeout_s=60)
        held = pages_used(l4m_up)
        assert held["scheduler_kv_pages"] == baseline.held["scheduler_kv_pages"] + last["exported"], (held, last)
        print(f"alice pinned {last['exported']} pages (quota {quota}) after exiting; pages held {held}")
        assert greedy_completion(l4m_up) == baseline.tokens  # the admin, another user, still gets pages
    finally:
        released = users.alice.run(HOARDER, "release", PREFIX)
    assert released.reason == "EXIT_REASON_EXITED" and json.loads(released.messages[-1]) == {"left": []}, released.describe()
    wait_until(lambda: pages_used(l4m_up)["scheduler_kv_pages"] == baseline.held["scheduler_kv_pages"], timeout_s=10)
