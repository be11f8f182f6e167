"""A throw-away CA and per-daemon certificates for mutual TLS, made with the `openssl` CLI.

For tests, demos and trying TLS out; production certificates come from the operator's own
PKI (cert-manager, Vault...), with the same shape: one certificate per daemon, naming its
`daemon.name` as a DNS subjectAltName (plus any addresses it is dialed at, which kvxferd
does not check but other tools may), usable for both TLS server and client
authentication, signed by the CA every peer has as `daemon.tls_ca_file`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvxferd.errors import KvxferdError

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(frozen=True)
class IssuedCert:
    name: str
    cert_file: Path
    key_file: Path
    ca_file: Path

    def daemon_settings(self) -> dict[str, str]:
        """The daemon-section keys that use this certificate."""
        return {
            "tls_cert_file": str(self.cert_file),
            "tls_key_file": str(self.key_file),
            "tls_ca_file": str(self.ca_file),
        }


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise KvxferdError("the openssl command is not installed (Debian: apt-get install openssl)")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise KvxferdError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def make_ca(directory: Path, days: int = 30) -> tuple[Path, Path]:
    """A new CA (ca.pem, ca.key) in `directory`; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "ca.pem", directory / "ca.key"
    _openssl(
        "req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt",
        "ec_paramgen_curve:prime256v1", "-keyout", key.name, "-out", cert.name,
        "-days", str(days), "-subj", "/CN=kvxferd test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    key.chmod(0o600)
    return cert, key


def issue(
    directory: Path, name: str, ca: tuple[Path, Path] | None = None, days: int = 30
) -> IssuedCert:
    """A certificate and key for daemon `name` signed by `ca` (made in `directory` when
    None): <name>.pem, <name>.key."""
    if not _NAME.fullmatch(name):
        raise KvxferdError(f"{name!r} is not a daemon name (letters, digits, '_', '.', '-')")
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = ca if ca is not None else _existing_or_new_ca(directory, days)
    key, csr, cert = (directory / f"{name}{ext}" for ext in (".key", ".csr", ".pem"))
    ext = directory / f"{name}.ext"
    ext.write_text(
        f"subjectAltName=DNS:{name}\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        "req", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", key.name, "-out", csr.name, "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", csr.name, "-CA", str(ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", cert.name, "-days", str(days), "-extfile", ext.name,
        cwd=directory,
    )  # fmt: skip
    key.chmod(0o600)
    csr.unlink()
    ext.unlink()
    return IssuedCert(name, cert, key, ca_cert)


def _existing_or_new_ca(directory: Path, days: int) -> tuple[Path, Path]:
    cert, key = directory / "ca.pem", directory / "ca.key"
    if cert.exists() and key.exists():
        return cert, key
    return make_ca(directory, days)
