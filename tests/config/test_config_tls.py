"""The daemon section's mutual-TLS files: all three or none, relative to the file, loaded
at start-up and checked to name the daemon, every mistake named by its setting and line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvxferd.config import load_config, resolve
from kvxferd.errors import ConfigError
from kvxferd.peers import testca
from kvxferd.service.reload import startup_problems

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="mutual TLS needs 3.11")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    testca.issue(d, "ctx")
    testca.issue(d, "other")
    return d


def write(tmp: Path, daemon: str) -> Path:
    path = tmp / "ctx.yaml"
    path.write_text(f"daemon:\n  name: ctx\n{daemon}")
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.problems


def tls_problems(tmp: Path, cert: object, key: object, ca: object) -> list[str]:
    """The problems of a file naming these three TLS files (on lines 3, 4 and 5)."""
    return problems_of(
        write(tmp, f"  tls_cert_file: {cert}\n  tls_key_file: {key}\n  tls_ca_file: {ca}\n")
    )


def test_relative_paths_are_taken_from_the_file_and_the_files_load(
    certs: Path, tmp_path: Path
) -> None:
    (tmp_path / "tls").symlink_to(certs)
    cfg = load_config(
        write(
            tmp_path,
            "  tls_cert_file: tls/ctx.pem\n  tls_key_file: tls/ctx.key\n"
            "  tls_ca_file: tls/ca.pem\n  peer_listen: 0.0.0.0:47400\n",
        )
    )
    assert cfg.daemon.tls_cert_file == str(tmp_path / "tls" / "ctx.pem")
    assert cfg.daemon.peers_authenticated
    # TLS alone authenticates peers: a non-loopback listener needs no shared secret.
    assert startup_problems(cfg, resolve(cfg)) == []


def test_two_of_three_is_refused_naming_the_missing_one(certs: Path, tmp_path: Path) -> None:
    found = problems_of(
        write(tmp_path, f"  tls_cert_file: {certs}/ctx.pem\n  tls_ca_file: {certs}/ca.pem\n")
    )
    assert any("tls_key_file not" in p for p in found), found


def test_an_unreadable_file_is_named_with_its_line(certs: Path, tmp_path: Path) -> None:
    found = tls_problems(tmp_path, f"{certs}/ctx.pem", f"{tmp_path}/missing.key", f"{certs}/ca.pem")
    assert len(found) == 1 and "daemon.tls_key_file" in found[0], found
    assert "missing.key" in found[0] and "(line 4)" in found[0], found


def test_a_key_that_is_not_the_certificates_is_refused(certs: Path, tmp_path: Path) -> None:
    found = tls_problems(tmp_path, f"{certs}/ctx.pem", f"{certs}/other.key", f"{certs}/ca.pem")
    assert "daemon.tls_key_file" in found[0] and "not the certificate's key" in found[0], found


def test_a_ca_file_that_is_not_pem_is_refused(certs: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "ca.txt"
    bogus.write_text("not a certificate\n")
    found = tls_problems(tmp_path, f"{certs}/ctx.pem", f"{certs}/ctx.key", bogus)
    assert "daemon.tls_ca_file" in found[0] and "not PEM" in found[0], found


def test_a_certificate_for_another_daemon_is_refused(certs: Path, tmp_path: Path) -> None:
    found = tls_problems(tmp_path, f"{certs}/other.pem", f"{certs}/other.key", f"{certs}/ca.pem")
    assert "daemon.tls_cert_file" in found[0] and "names other, not this daemon (ctx)" in found[0]
