"""After every attack of this directory (the files run in name order; this one is last): a normal
controller gets the same greedy tokens as before the first, everything an instance held is back, and the
scheduler and the executor agree on every KV page and embedding slot."""

from __future__ import annotations

from tests.integration.harness import UpCluster
from tests.integration.security.conftest import Baseline, greedy_completion, pages_used, wait_until

SETTLE_S = 10.0  # deallocations reach the executor after the scheduler counted them free


def test_the_cluster_is_unharmed(l4m_up: UpCluster, baseline: Baseline) -> None:
    assert greedy_completion(l4m_up) == baseline.tokens

    def settled() -> bool:
        held = pages_used(l4m_up)
        return (held["scheduler_kv_pages"] == held["executor_kv_pages"] == baseline.held["scheduler_kv_pages"]
                and held["scheduler_embed_slots"] == held["executor_embed_slots"]
                == baseline.held["scheduler_embed_slots"])

    try:
        wait_until(settled, timeout_s=SETTLE_S)
    except AssertionError:
        raise AssertionError(f"held now {pages_used(l4m_up)}, before the attacks {baseline.held}") from None
