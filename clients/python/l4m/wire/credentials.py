"""Credentials every service and client shares: bearer secrets in files, and TLS on TCP.

One module so that each listener and each channel is built the same way:
- A *secret file* holds one high-entropy secret (the cluster secret of the control plane, an API key
  for the CLI). `write_secret_file` creates it owner-only (0600); `read_secret_file` refuses one that
  others may read or that is too short, with an error that says which file and why.
- A caller presents a secret as `authorization: Bearer <secret>` metadata (`bearer_metadata`); a
  server reads it back with `bearer_token` and compares with `secrets_equal` (constant time).
- `add_listener` binds a gRPC server to an address, with TLS when a certificate and key are given
  (TCP only: a Unix socket is protected by its directory's permissions instead). `open_channel`
  is the client side: TLS when a CA file is given.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from l4m.wire.metadata import AUTHORIZATION_METADATA_KEY, BEARER_PREFIX

MIN_SECRET_CHARS = 16
SECRET_BYTES = 32  # of randomness in a generated secret (43 url-safe characters)


class CredentialError(ValueError):
    """A secret, key or certificate file that cannot be used; the message names the file."""


def new_secret() -> str:
    return secrets.token_urlsafe(SECRET_BYTES)


def write_secret_file(path: Path, secret: str | None = None) -> str:
    """Creates `path` (mode 0600) holding `secret` (a new one when None) unless it exists; returns the
    secret the file holds. Parents are created 0700."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        return read_secret_file(path)
    secret = secret or new_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")
    return secret


def read_secret_file(path: Path) -> str:
    """The secret in `path`; refuses a file that group or others may read, or a short secret."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as error:
        raise CredentialError(f"cannot read the secret file {path}: {error.strerror or error}") from error
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialError(f"the secret file {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
                              f"chmod 600 it")
    if len(text) < MIN_SECRET_CHARS:
        raise CredentialError(f"the secret in {path} is shorter than {MIN_SECRET_CHARS} characters")
    return text


def bearer_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION_METADATA_KEY, BEARER_PREFIX + secret),)


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The secret of an `authorization: Bearer <secret>` entry, or None when there is none."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_METADATA_KEY and isinstance(value, str) and value.startswith(BEARER_PREFIX):
            return value[len(BEARER_PREFIX):].strip()
    return None


def secrets_equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate chain and private key, PEM files."""

    cert_path: Path
    key_path: Path

    def server_credentials(self) -> grpc.ServerCredentials:
        try:
            chain, key = self.cert_path.read_bytes(), self.key_path.read_bytes()
        except OSError as error:
            raise CredentialError(f"cannot read TLS file {error.filename}: {error.strerror}") from error
        return grpc.ssl_server_credentials(((key, chain),))


def tls_files(cert_path: Path | None, key_path: Path | None) -> TlsFiles | None:
    """From a pair of flags: both or neither (an error names the one missing)."""
    if cert_path is None and key_path is None:
        return None
    if cert_path is None or key_path is None:
        raise CredentialError("--tls-cert and --tls-key go together: give both or neither")
    return TlsFiles(cert_path, key_path)


def is_unix_address(address: str) -> bool:
    return address.startswith("unix:")


def is_loopback_host(host: str) -> bool:
    """Whether a host name or IP address (no port, no brackets) is this host's loopback: `localhost` or
    an address in 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_listener(server: grpc.aio.Server, address: str, tls: TlsFiles | None) -> int:
    """Binds `server` to `address`; TLS when `tls` is given and the address is TCP. Returns the port
    (0 for a Unix socket); raises OSError when the address cannot be bound."""
    if tls is not None and not is_unix_address(address):
        port = server.add_secure_port(address, tls.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if not port and not is_unix_address(address):
        raise OSError(f"could not listen on {address}")
    return port


def channel_credentials(ca_path: Path) -> grpc.ChannelCredentials:
    try:
        return grpc.ssl_channel_credentials(ca_path.read_bytes())
    except OSError as error:
        raise CredentialError(f"cannot read the TLS CA file {ca_path}: {error.strerror}") from error


def open_channel(address: str, ca_path: Path | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An aio channel to `address`: TLS verified against `ca_path` when given, plain otherwise."""
    if ca_path is not None and not is_unix_address(address):
        return grpc.aio.secure_channel(address, channel_credentials(ca_path), options=list(options))
    return grpc.aio.insecure_channel(address, options=list(options))
