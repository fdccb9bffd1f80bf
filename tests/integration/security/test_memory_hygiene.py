"""Issue #17, attack 1, as written: a controller that gets another user's freed KV pages and embedding
slots reads them without writing them first. It must see exactly what a never-used page or slot holds
(the executor zeroes on allocation), whatever the previous owner wrote; the same probe on the owner's
own pages does depend on the secret, so the check is able to fail."""

from __future__ import annotations

import json

from tests.integration.security.conftest import CONTROLLERS, Users

LEAK = CONTROLLERS / "leak.py"


def _report(ended) -> dict:  # type: ignore[no-untyped-def]
    assert ended.reason == "EXIT_REASON_EXITED", ended.describe()
    return json.loads(ended.messages[-1])


def test_freed_pages_and_slots_show_nothing_of_their_previous_owner(users: Users) -> None:
    seen = {}
    for secret in ("739184", "205617"):
        victim = _report(users.alice.run(LEAK, "victim", secret))
        attacker = _report(users.bob.run(LEAK, "attacker"))
        seen[secret] = (victim, attacker)
    (victim_a, attacker_a), (victim_b, attacker_b) = seen.values()
    # The probe sees what a page or slot holds: the owner's own, written ones differ with the secret.
    assert victim_a["pages"] != victim_b["pages"]
    assert victim_a["slots"] != victim_b["slots"]
    # The attacker's, on the pages and slots the victim just freed, do not: all alike, after either victim.
    assert attacker_a == attacker_b
    assert all(probe == attacker_a["pages"][0] for probe in attacker_a["pages"]), attacker_a["pages"]
    assert all(probe == attacker_a["slots"][0] for probe in attacker_a["slots"]), attacker_a["slots"]
    assert attacker_a["pages"][0] not in (victim_a["pages"][0], victim_b["pages"][0])
