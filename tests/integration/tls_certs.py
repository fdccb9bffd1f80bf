"""A throwaway CA and a server certificate for 127.0.0.1 / localhost, made with the `openssl` command."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertificateFiles:
    ca_path: Path  # the CA certificate clients trust
    cert_path: Path  # the server's certificate, signed by the CA, valid for 127.0.0.1 and localhost
    key_path: Path  # the server's private key


def make_certificates(directory: Path, ip_addresses: tuple[str, ...] = ("127.0.0.1",)) -> CertificateFiles:
    """`ip_addresses`: the addresses the server certificate names (with localhost)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = directory / "ca.key", directory / "ca.pem"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.pem"
    ext = directory / "server.ext"
    names = ",".join(f"IP:{address}" for address in ip_addresses)
    ext.write_text(f"subjectAltName={names},DNS:localhost\nbasicConstraints=CA:FALSE\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca_cert),
            "-days", "2", "-subj", "/CN=l4m test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return CertificateFiles(ca_cert, cert, key)
