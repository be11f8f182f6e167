"""The daemon.discovery and daemon.etcd settings: what loads, and errors naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvxferd.config import load_config, load_config_text, resolve
from kvxferd.config.discovery import EtcdSection, advertised_address
from kvxferd.config.explain import explain_lines
from kvxferd.errors import ConfigError, StartupError

ETCD = "  discovery: etcd\n  etcd:\n    endpoints: ['127.0.0.1:2379']\n"


def problems(text: str, base_dir: str | None = None) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        load_config_text(text, "d.yaml", base_dir=base_dir)
    return raised.value.problems


def test_static_is_the_default_and_etcd_loads() -> None:
    assert load_config_text("", "d.yaml").daemon.discovery == "static"
    cfg = load_config_text("daemon:\n" + ETCD + "    cluster: prod\n", "d.yaml")
    assert cfg.daemon.etcd is not None
    assert cfg.daemon.etcd.lease_ttl_s == 10 and cfg.daemon.etcd.prefix == "/kvxferd/prod/daemons/"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("daemon:\n  discovery: etcd\n", "discovery: etcd needs an etcd section"),
        ("daemon:\n  etcd:\n    endpoints: ['a:1']\n", "discovery is static"),
        ("daemon:\n  peers: {ctx: '127.0.0.1:1'}\n" + ETCD, "do not mix"),
        ("daemon:\n" + ETCD + "    lease_ttl_s: 1\n", "daemon.etcd.lease_ttl_s: must be greater"),
        ("daemon:\n" + ETCD + "    cluster: 'a/b'\n", "daemon.etcd.cluster"),
        ("daemon:\n  discovery: etcd\n  etcd:\n    endpoints: []\n", "daemon.etcd.endpoints"),
        ("daemon:\n  discovery: etcd\n  etcd:\n    endpoints: [nohost]\n", "endpoints.0"),
        ("daemon:\n  peer_listen: 0.0.0.0:0\n" + ETCD, "etcd.advertise_address: needed"),
        ("daemon:\n" + ETCD + "    advertise_address: 0.0.0.0\n", "wildcard"),
        ("daemon:\n" + ETCD + "    cert_file: c.pem\n", "cert_file and key_file go together"),
        ("daemon:\n" + ETCD + "    username: u\n", "username and password_file"),
        ("daemon:\n" + ETCD + "    tp_rank: 1\n", "daemon.etcd.tp_rank: must be below"),
        ("daemon:\n" + ETCD + "    lease_ttl_s: '10'\n", "daemon.etcd.lease_ttl_s"),
    ],
)
def test_bad_settings_name_the_setting(text: str, expected: str) -> None:
    found = problems(text)
    assert any(expected in p for p in found), found


def test_files_are_relative_to_the_config_and_read_at_load(tmp_path: Path) -> None:
    text = "daemon:\n" + ETCD + "    username: u\n    password_file: pw\n    ca_file: ca.pem\n"
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    (problem,) = raised.value.problems
    assert "daemon.etcd.password_file" in problem and str(tmp_path / "pw") in problem
    assert "(line 6)" in problem
    (tmp_path / "pw").write_text("sesame\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert "daemon.etcd.ca_file" in raised.value.problems[0]
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    cfg = load_config(path)
    assert cfg.daemon.etcd is not None and cfg.daemon.etcd.read_password() == "sesame"
    assert cfg.daemon.etcd.ca_file == str(tmp_path / "ca.pem")


def test_the_advertised_address() -> None:
    etcd = load_config_text("daemon:\n" + ETCD, "d.yaml").daemon.etcd
    assert etcd is not None
    assert advertised_address(etcd, "127.0.0.1:4000") == "127.0.0.1:4000"
    with pytest.raises(ConfigError):
        advertised_address(etcd, "0.0.0.0:4000")
    host_only = etcd.model_copy(update={"advertise_address": "10.0.0.2"})
    assert advertised_address(host_only, "0.0.0.0:4000") == "10.0.0.2:4000"
    v6 = etcd.model_copy(update={"advertise_address": "fd00::2"})
    assert advertised_address(v6, "[::]:4000") == "[fd00::2]:4000"
    full = etcd.model_copy(update={"advertise_address": "gen-0.svc:47400"})
    assert advertised_address(full, "0.0.0.0:4000") == "gen-0.svc:47400"


def test_explain_says_how_names_resolve() -> None:
    cfg = load_config_text("daemon:\n" + ETCD + "    cluster: prod\n", "d.yaml")
    (line,) = [x for x in explain_lines(cfg, resolve(cfg)) if x.startswith("discovery:")]
    assert "etcd at 127.0.0.1:2379 (plaintext)" in line and "/kvxferd/prod/daemons/" in line
    static = load_config_text("", "d.yaml")
    lines = explain_lines(static, resolve(static))
    assert any(x.startswith("discovery:          static") for x in lines)


def test_advertise_auto_is_the_address_on_the_route_to_etcd() -> None:
    """In a pod, the pod's IP; here, with etcd on loopback, the loopback address."""
    auto = EtcdSection(endpoints=["127.0.0.1:2379"], advertise_address="auto")
    assert advertised_address(auto, "0.0.0.0:4000") == "127.0.0.1:4000"
    # The first endpoint that resolves gives the route; the others are not asked.
    later = EtcdSection(
        endpoints=["no-such-host.invalid:2379", "127.0.0.1:2379"], advertise_address="auto"
    )
    assert advertised_address(later, "[::]:4001") == "127.0.0.1:4001"
    nowhere = EtcdSection(endpoints=["no-such-host.invalid:2379"], advertise_address="auto")
    with pytest.raises(StartupError, match=r"no route to any etcd endpoint.*no-such-host"):
        advertised_address(nowhere, "0.0.0.0:4000")
