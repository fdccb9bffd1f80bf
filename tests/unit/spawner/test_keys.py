"""The API key store (`l4m.keys`) and the spawner's authenticator over it: hashed at rest, owner-only,
re-read when the file changes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from l4m.common.users import Authenticator, Unauthenticated
from l4m.keys import ADMIN_KEY_FILE_NAME, KEYS_FILE_NAME, KeyStore, KeyStoreError, ensure_admin_key


def test_a_key_is_stored_only_as_its_sha256_in_an_owner_only_file(tmp_path: Path) -> None:
    path = tmp_path / "state" / KEYS_FILE_NAME
    key = KeyStore.load(path).add("alice", "user", max_instances=2, max_tokens_per_minute=100)
    assert key.startswith("l4m_") and len(key) == 4 + 43
    text = path.read_text()
    assert key not in text and key[4:] not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entry = KeyStore.load(path).authenticate(key)
    assert entry is not None and (entry.name, entry.role, entry.max_instances, entry.max_tokens_per_minute) == (
        "alice", "user", 2, 100)
    assert KeyStore.load(path).authenticate(key + "x") is None
    assert json.loads(text)["keys"][0]["name"] == "alice"


def test_names_and_roles_are_checked_and_remove_revokes(tmp_path: Path) -> None:
    store = KeyStore.load(tmp_path / KEYS_FILE_NAME)
    with pytest.raises(KeyStoreError, match="role"):
        store.add("bob", "root")
    key = store.add("bob")
    with pytest.raises(KeyStoreError, match="exists already"):
        store.add("bob")
    store.remove("bob")
    assert KeyStore.load(tmp_path / KEYS_FILE_NAME).authenticate(key) is None
    with pytest.raises(KeyStoreError, match="no key named"):
        store.remove("bob")


def test_ensure_admin_key_is_idempotent(tmp_path: Path) -> None:
    key = ensure_admin_key(tmp_path)
    assert ensure_admin_key(tmp_path) == key
    assert stat.S_IMODE((tmp_path / ADMIN_KEY_FILE_NAME).stat().st_mode) == 0o600
    entry = KeyStore.load(tmp_path / KEYS_FILE_NAME).authenticate(key)
    assert entry is not None and entry.name == "admin" and entry.is_admin
    assert len(KeyStore.load(tmp_path / KEYS_FILE_NAME).keys()) == 1


def test_the_authenticator_rereads_the_file_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / KEYS_FILE_NAME
    first = KeyStore.load(path).add("alice")
    authenticator = Authenticator(path)
    assert authenticator.authenticate(first).name == "alice"
    second = KeyStore.load(path).add("bob", "admin")
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)  # mtime granularity: make the change visible
    user = authenticator.authenticate(second)
    assert (user.name, user.is_admin) == ("bob", True)
    KeyStore.load(path).remove("alice")
    os.utime(path, ns=(path.stat().st_mtime_ns + 2 * 10**9,) * 2)
    with pytest.raises(Unauthenticated, match="not known"):
        authenticator.authenticate(first)


def test_no_key_is_refused_unless_insecure_local_and_a_wrong_key_always(tmp_path: Path) -> None:
    path = tmp_path / KEYS_FILE_NAME
    with pytest.raises(Unauthenticated, match="needs an API key"):
        Authenticator(path).authenticate(None)
    local = Authenticator(None, insecure_local=True)
    assert (local.authenticate(None).name, local.authenticate("").is_admin) == ("local", True)
    with pytest.raises(Unauthenticated, match="not known"):
        local.authenticate("l4m_wrong")
