"""The `daemon.etcd:` section: how a daemon with `daemon.discovery: etcd` reaches etcd and
what it registers there (kvxferd.discovery.etcd; docs/operations.md, "Discovery with etcd").

Only the shape is checked here. Files (TLS, password) are read when the configuration is
loaded (kvxferd.config.loader), so an unreadable one is an error naming its setting
before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field, model_validator

from kvxferd.config.fields import NAME_PATTERN, SECTION_CONFIG, parse_hostport
from kvxferd.errors import ConfigError, StartupError
from kvxferd.hostport import source_address_towards

# What etcd grants with its default flags (election timeout 1 s): asking for less is
# silently granted 2 s, so a smaller setting would only mislead.
MIN_LEASE_TTL_S = 2
ETCD_TLS_FIELDS = ("ca_file", "cert_file", "key_file")
ETCD_FILE_FIELDS = (*ETCD_TLS_FIELDS, "password_file")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _endpoint(value: str) -> str:
    parse_hostport(value, min_port=1)
    return value


# advertise_address: this host's address on the route to etcd (ADVERTISE_AUTO).
ADVERTISE_AUTO = "auto"


def _advertise(value: str) -> str:
    """ "host:port", a bare host (the port is the peer listener's own), or "auto"."""
    if value == ADVERTISE_AUTO:
        return value
    if value.startswith("[") or value.count(":") == 1:
        host, _ = parse_hostport(value, min_port=1)
    else:
        host, _ = parse_hostport(f"[{value}]:1" if ":" in value else f"{value}:1", min_port=1)
    if host in WILDCARD_HOSTS:
        raise ValueError(
            f"{value!r} is a wildcard address; peers need one they can dial (this host's "
            "address on the network the peers share)"
        )
    return value


Endpoint = Annotated[str, AfterValidator(_endpoint)]
Advertise = Annotated[str, AfterValidator(_advertise)]


class EtcdSection(BaseModel):
    """Where etcd is, how this daemon authenticates to it, and what it registers there."""

    model_config = SECTION_CONFIG

    endpoints: list[Endpoint] = Field(
        min_length=1,
        description="etcd client endpoints as host:port (the members' client URLs without "
        "the scheme); tried in order, the next one when one cannot be reached.",
    )
    cluster: str = Field(
        default="default",
        pattern=NAME_PATTERN,
        description="Cluster name: daemons see each other only within one cluster; keys "
        "live under /kvxferd/<cluster>/daemons/.",
    )
    lease_ttl_s: int = Field(
        default=10,
        ge=MIN_LEASE_TTL_S,
        le=3600,
        description="TTL of this daemon's lease: a daemon that dies disappears from "
        "discovery this long after its last keepalive (sent every lease_ttl_s / 3). "
        f"At least {MIN_LEASE_TTL_S}, what etcd grants with its default flags.",
    )
    connect_timeout_ms: int = Field(
        default=2000,
        gt=0,
        description="Longest wait for one etcd call; at start-up, how long etcd is waited "
        "for before the daemon starts with discovery down (it registers when etcd comes).",
    )
    advertise_address: Advertise | None = Field(
        default=None,
        min_length=1,
        description="Address other daemons dial for this one's peer listener: host:port, or "
        "a host alone (the port is the listener's own, useful with port 0), or auto: this "
        "host's address on the route to the first etcd endpoint that resolves (a pod's "
        "own IP in Kubernetes). null: the actual listen address; required when "
        "daemon.peer_listen is a wildcard (0.0.0.0 or [::]).",
    )
    tp_rank: int = Field(
        default=0,
        ge=0,
        description="This daemon's tensor-parallel rank within its engine instance "
        "(registered with engine.tensor_parallel_size for routers; must be below it).",
    )
    ca_file: str | None = Field(
        default=None,
        min_length=1,
        description="PEM CA certificate(s) etcd's server certificate must be signed by; set "
        "it to talk TLS to etcd. Relative paths are relative to the configuration file.",
    )
    cert_file: str | None = Field(
        default=None,
        min_length=1,
        description="PEM client certificate for etcd (client-certificate authentication); "
        "set with key_file and ca_file.",
    )
    key_file: str | None = Field(
        default=None, min_length=1, description="PEM private key of cert_file (unencrypted)."
    )
    username: str | None = Field(
        default=None,
        min_length=1,
        description="etcd user (etcd's own authentication); set with password_file.",
    )
    password_file: str | None = Field(
        default=None,
        min_length=1,
        description="File holding the etcd user's password (trailing whitespace stripped).",
    )

    @model_validator(mode="after")
    def _pairs(self) -> EtcdSection:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: set both or neither")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError("a client certificate (cert_file) is for TLS to etcd: set ca_file too")
        if (self.username is None) != (self.password_file is None):
            raise ValueError("username and password_file go together: set both or neither")
        return self

    @property
    def prefix(self) -> str:
        """Every key of this cluster starts with it (docs/operations.md)."""
        return f"/kvxferd/{self.cluster}/daemons/"

    def endpoint_hostports(self) -> list[tuple[str, int]]:
        return [parse_hostport(e, min_port=1) for e in self.endpoints]

    def read_password(self) -> str | None:
        """The etcd password (None without credentials); ConfigError naming the file."""
        if self.password_file is None:
            return None
        where = "daemon.etcd.password_file"
        try:
            text = Path(self.password_file).read_text(encoding="utf-8").rstrip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            problem = f"{where}: cannot read {self.password_file!r}: {reason}"
            raise ConfigError(problem, problems=[problem]) from None
        if not text:
            problem = f"{where}: {self.password_file!r} is empty"
            raise ConfigError(problem, problems=[problem])
        return text

    def read_tls(self) -> tuple[bytes, bytes | None, bytes | None] | None:
        """(CA, client certificate, client key) as PEM bytes, or None without TLS;
        ConfigError naming the setting whose file cannot be read."""
        if self.ca_file is None:
            return None
        out: list[bytes | None] = []
        for field in ETCD_TLS_FIELDS:
            path = getattr(self, field)
            if path is None:
                out.append(None)
                continue
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                problem = f"daemon.etcd.{field}: cannot read {path!r}: {exc.strerror or exc}"
                raise ConfigError(problem, problems=[problem]) from None
            if b"-----BEGIN" not in data:
                problem = f"daemon.etcd.{field}: {path!r} holds no PEM data"
                raise ConfigError(problem, problems=[problem])
            out.append(data)
        ca, cert, key = out
        if ca is None:
            return None
        return ca, cert, key


def advertised_address(etcd: EtcdSection, listen_address: str) -> str:
    """What this daemon registers as its peer address: advertise_address (a bare host gets
    the listener's port), or the listener's actual address when that is not a wildcard."""
    listen_host, listen_port = parse_hostport(listen_address)
    given = etcd.advertise_address
    if given is None:
        if listen_host in WILDCARD_HOSTS:
            raise ConfigError(
                "daemon.etcd.advertise_address: needed when daemon.peer_listen is a wildcard "
                f"({listen_address})",
                problems=[],
            )
        return listen_address
    if given == ADVERTISE_AUTO:
        given = _route_to_etcd(etcd)
    elif given.startswith("[") or given.count(":") == 1:
        return given
    return f"[{given}]:{listen_port}" if ":" in given else f"{given}:{listen_port}"


def _route_to_etcd(etcd: EtcdSection) -> str:
    """advertise_address auto: the source address towards the first endpoint that
    resolves; a clear error naming each endpoint's problem when none does."""
    problems = []
    for endpoint in etcd.endpoints:
        try:
            return source_address_towards(endpoint)
        except (OSError, ValueError) as exc:
            problems.append(f"{endpoint}: {exc}")
    raise StartupError(
        "daemon.etcd.advertise_address auto: no route to any etcd endpoint to take this "
        f"host's address from ({'; '.join(problems)}); set the address itself"
    )
