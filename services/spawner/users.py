"""Which programs each user uploaded (who calls the spawner is `l4m.common.users`).

`ProgramOwners` records the users who uploaded each program. The store is content-addressed and
shared, but what a user may list or launch is what that user uploaded (an admin: everything), so a
program's digest or tag learned elsewhere does not let another user run it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from l4m.common.users import User


class ProgramOwners:
    """sha256 -> the users who uploaded it, kept in one JSON file beside the store."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._owners = {sha: set(users) for sha, users in json.loads(path.read_text()).items()}
        except (FileNotFoundError, ValueError):
            self._owners: dict[str, set[str]] = {}

    def add(self, sha256: str, user: str) -> None:
        users = self._owners.setdefault(sha256, set())
        if user in users:
            return
        users.add(user)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text(json.dumps({sha: sorted(u) for sha, u in self._owners.items()}))
        os.replace(temporary, self.path)

    def may_use(self, sha256: str, user: User) -> bool:
        return user.is_admin or user.name in self._owners.get(sha256, ())
