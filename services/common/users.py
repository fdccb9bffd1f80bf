"""Who calls a service of the cluster with an API key: keys to users (the spawner's and the gateway's).

`Authenticator` turns the bearer key of a call into a `User` (name, role, quotas) from the operator's
key store (`l4m.keys`), re-reading the file when its mtime changes so that `l4m keys add` works on a
running service. With `insecure_local` a call without a key is the user "local", an admin (for
one-person development machines on loopback only). A wrong key is refused either way.
"""

from __future__ import annotations

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
            raise Unauthenticated("the API key is not known to this cluster")
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
                    raise Unauthenticated(f"the service cannot read its keys: {error}") from error
                # A half-edited file: keep the keys read last until it is valid again.
            self._mtime_ns = mtime_ns
        return self._store
