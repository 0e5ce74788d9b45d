"""Certificates for the remote tier's TLS tests, made with the `openssl` command:
a private CA, a server certificate it signs for 127.0.0.1, and a second CA that
signed nothing the servers present."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl")


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path

    def server_args(self) -> list[str]:
        """redis-server options: these files, clients not asked for certificates."""
        return [
            "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
            "--tls-ca-cert-file", str(self.ca), "--tls-auth-clients", "no",
        ]  # fmt: skip


def _run(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> Certs:
    d.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-subj", f"/CN=kvstore test {ca}",
             cwd=d)  # fmt: skip
    _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=127.0.0.1", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "2", "-out", "server.pem", "-extfile", "san.ext",
         cwd=d)  # fmt: skip
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key", d / "other-ca.pem")
