"""API keys of the spawner's users: a JSON file the operator manages (`l4m keys add/list/remove`).

The file (`<state dir>/api-keys.json`, mode 0600) holds, per key, its name, role ("admin" sees and may
end every user's instances; "user" only its own), per-key quotas (0: the spawner's default) and the
sha256 of the key, never the key itself: `add` prints the plaintext once. A key is `l4m_` + 43
url-safe random characters (256 bits), so a plain sha256 at rest cannot be brute-forced and no slow
password hash is needed. `authenticate` compares digests in constant time.

`ensure_admin_key` is what `l4m up` calls: an "admin" entry plus `<state dir>/admin.key` (the plaintext,
0600) that the local CLI reads when it is given no key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from l4m.wire.credentials import CredentialError, read_secret_file, write_secret_file

KEYS_FILE_NAME = "api-keys.json"
ADMIN_KEY_FILE_NAME = "admin.key"
ADMIN_KEY_NAME = "admin"
KEY_PREFIX = "l4m_"
KEY_BYTES = 32  # 256 bits: 43 url-safe characters
ROLES = ("admin", "user")


class KeyStoreError(ValueError):
    """A keys file that cannot be read, or a change that cannot be made; the message says why."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    role: str  # "admin" | "user"
    key_sha256: str
    max_instances: int = 0  # 0: the spawner's --max-instances-per-user
    max_tokens_per_minute: int = 0  # 0: the spawner's --max-tokens-per-minute-per-user

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


class KeyStore:
    """The keys in one file; every change is written back at once (atomically, 0600)."""

    def __init__(self, path: Path, keys: list[ApiKey]) -> None:
        self.path = path
        self._keys = {key.name: key for key in keys}

    @classmethod
    def load(cls, path: Path) -> KeyStore:
        """The store in `path`; a missing file is an empty store."""
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls(path, [])
        except OSError as error:
            raise KeyStoreError(f"cannot read the keys file {path}: {error.strerror or error}") from error
        try:
            entries = json.loads(text)["keys"]
            keys = [ApiKey(**entry) for entry in entries]
        except (ValueError, KeyError, TypeError) as error:
            raise KeyStoreError(f"the keys file {path} is not valid: {error}") from error
        return cls(path, keys)

    def keys(self) -> list[ApiKey]:
        return sorted(self._keys.values(), key=lambda k: k.name)

    def authenticate(self, key: str) -> ApiKey | None:
        """The entry whose digest is the key's; every entry is compared, in constant time each."""
        digest = key_digest(key).encode()
        found = None
        for entry in self._keys.values():
            if hmac.compare_digest(entry.key_sha256.encode(), digest):
                found = entry
        return found

    def add(self, name: str, role: str = "user", max_instances: int = 0, max_tokens_per_minute: int = 0) -> str:
        """Adds a key named `name`, saves, and returns the plaintext key (shown once, never stored)."""
        return self._add(name, new_key(), role, max_instances, max_tokens_per_minute)

    def _add(self, name: str, key: str, role: str, max_instances: int, max_tokens_per_minute: int) -> str:
        if not name or name.strip() != name:
            raise KeyStoreError(f"a key name must be non-empty without surrounding spaces, not {name!r}")
        if role not in ROLES:
            raise KeyStoreError(f"the role must be one of {', '.join(ROLES)}, not {role!r}")
        if max_instances < 0 or max_tokens_per_minute < 0:
            raise KeyStoreError("quotas must be 0 (the spawner's default) or more")
        if name in self._keys:
            raise KeyStoreError(f"a key named {name!r} exists already in {self.path} (remove it first)")
        self._keys[name] = ApiKey(name, role, key_digest(key), max_instances, max_tokens_per_minute)
        self.save()
        return key

    def remove(self, name: str) -> None:
        if name not in self._keys:
            raise KeyStoreError(f"no key named {name!r} in {self.path}")
        del self._keys[name]
        self.save()

    def save(self) -> None:
        """Writes a temporary file (0600) and renames it over the store, so a reader never sees half."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        text = json.dumps({"keys": [asdict(key) for key in self.keys()]}, indent=2) + "\n"
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(temporary, self.path)


def ensure_admin_key(state_dir: Path) -> str:
    """The local admin key: creates the "admin" entry in `state_dir/api-keys.json` and
    `state_dir/admin.key` (0600) when either is missing; returns the plaintext key. Idempotent."""
    key_path = state_dir / ADMIN_KEY_FILE_NAME
    store = KeyStore.load(state_dir / KEYS_FILE_NAME)
    key = read_secret_file(key_path) if key_path.exists() else write_secret_file(key_path, new_key())
    entry = store.authenticate(key)
    if entry is not None and entry.name == ADMIN_KEY_NAME and entry.is_admin:
        return key
    if any(k.name == ADMIN_KEY_NAME for k in store.keys()):  # noqa: SIM118 - a list, not a dict
        store.remove(ADMIN_KEY_NAME)  # an admin entry for another key file: this one is the local admin's
    store._add(ADMIN_KEY_NAME, key, "admin", 0, 0)
    return key


__all__ = [
    "ADMIN_KEY_FILE_NAME",
    "KEYS_FILE_NAME",
    "ApiKey",
    "CredentialError",
    "KeyStore",
    "KeyStoreError",
    "ensure_admin_key",
]
