"""Who calls the spawner: API keys to users, and which programs each user uploaded.

`Authenticator` turns the bearer key of a SpawnerService call into a `User` (name, role, quotas) from
the operator's key store (`l4m.keys`), re-reading the file when its mtime changes so that `l4m keys
add` works on a running spawner. With `insecure_local` a call without a key is the user "local", an
admin (for one-person development machines on loopback only). A wrong key is refused either way.

`ProgramOwners` records the users who uploaded each program. The store is content-addressed and
shared, but what a user may list or launch is what that user uploaded (an admin: everything), so a
program's digest or tag learned elsewhere does not let another user run it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from l4m.keys import KeyStore, KeyStoreError

LOCAL_USER = "local"


class Unauthenticated(Exception):
    """A call without a valid API key; the message says what was wrong (never the key)."""


@dataclass(frozen=True)
class User:
    name: str
    is_admin: bool = False
    max_instances: int = 0  # 0: the spawner's --max-instances-per-user
    max_tokens_per_minute: int = 0  # 0: the spawner's --max-tokens-per-minute-per-user

    def can_see(self, owner: str) -> bool:
        return self.is_admin or owner == self.name


ADMIN = User(LOCAL_USER, is_admin=True)


class Authenticator:
    def __init__(self, keys_path: Path | None, insecure_local: bool = False) -> None:
        self.keys_path = keys_path
        self.insecure_local = insecure_local
        self._store: KeyStore | None = None
        self._mtime_ns: int | None = None

    def authenticate(self, key: str | None) -> User:
        if not key:
            if self.insecure_local:
                return ADMIN
            raise Unauthenticated(
                "this call needs an API key (`authorization: Bearer <key>` metadata; `l4m keys add NAME` "
                "makes one)"
            )
        entry = self._current_store().authenticate(key) if self.keys_path is not None else None
        if entry is None:
            raise Unauthenticated("the API key is not known to this spawner")
        return User(entry.name, entry.is_admin, entry.max_instances, entry.max_tokens_per_minute)

    def _current_store(self) -> KeyStore:
        assert self.keys_path is not None
        try:
            mtime_ns = self.keys_path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime_ns = None
        if self._store is None or mtime_ns != self._mtime_ns:
            try:
                self._store = KeyStore.load(self.keys_path)
            except KeyStoreError as error:
                if self._store is None:
                    raise Unauthenticated(f"the spawner cannot read its keys: {error}") from error
                # A half-edited file: keep the keys read last until it is valid again.
            self._mtime_ns = mtime_ns
        return self._store


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
