"""The `engine:` and `daemon:` sections of a kvxferd configuration file.

`engine:` holds static facts about the inference server this daemon serves (what
resolution needs to decide runtime, bounce and pipelining); `daemon:` holds the
daemon's own addresses, timeouts and identity. Every field has a default, so both
sections may be left out of a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvxferd.config.discovery import WILDCARD_HOSTS, EtcdSection
from kvxferd.config.fields import NAME_PATTERN, SECTION_CONFIG, parse_hostport
from kvxferd.errors import ConfigError

Dtype = Literal["float16", "bfloat16", "float32", "float8", "int8"]
# The daemon section's mutual-TLS files: all three, or none.
_TLS_FIELDS = ("tls_cert_file", "tls_key_file", "tls_ca_file")
_ITEMSIZE: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8": 1, "int8": 1}


def _listen_address(value: str) -> str:
    parse_hostport(value, min_port=0)  # port 0: let the OS pick (useful in tests)
    return value


def _peer_address(value: str) -> str:
    parse_hostport(value, min_port=1)  # nobody can be reached on port 0
    return value


ListenAddress = Annotated[str, AfterValidator(_listen_address)]
PeerAddress = Annotated[str, AfterValidator(_peer_address)]
PeerName = Annotated[str, Field(pattern=NAME_PATTERN)]
PositiveInt = Annotated[int, Field(gt=0)]


class KvLayoutSpec(BaseModel):
    """Shape of one engine rank's KV pool, as the engine lays it out in memory."""

    model_config = SECTION_CONFIG

    num_layers: int = Field(default=32, gt=0, description="Transformer layers held in the pool.")
    num_kv_heads: int = Field(
        default=8, gt=0, description="KV heads per layer on this rank (after tensor parallelism)."
    )
    head_dim: int = Field(default=128, gt=0, description="Elements per head.")
    tokens_per_block: int = Field(
        default=32,
        gt=0,
        description="Tokens per KV block. max_tokens_in_buffer must be a multiple of it, "
        "and the admission window is counted in these blocks.",
    )
    dtype: Dtype = Field(default="float16", description="Element type of the KV cache.")
    layout: Literal["block-major", "layer-major"] = Field(
        default="block-major",
        description="block-major: all layers of a block are contiguous (one segment per "
        "block); layer-major: each layer is its own region (one segment per block and layer).",
    )

    @property
    def itemsize(self) -> int:
        """Bytes per element of `dtype`."""
        return _ITEMSIZE[self.dtype]


class EngineSection(BaseModel):
    """Static facts about the inference server (engine) this daemon serves."""

    model_config = SECTION_CONFIG

    role: Literal["context", "generation", "both"] = Field(
        default="both",
        description="context: prefill server (sends KV); generation: decode server "
        "(receives KV); both: one engine that does either.",
    )
    tensor_parallel_size: int = Field(default=1, gt=0, description="Tensor-parallel ranks.")
    pipeline_parallel_size: int = Field(
        default=1, gt=0, description="Pipeline-parallel ranks; pipelined transfer needs 1."
    )
    context_parallel_size: int = Field(
        default=1, gt=0, description="Context-parallel ranks; pipelined transfer needs 1."
    )
    enable_chunked_prefill: bool = Field(
        default=False,
        description="Whether the engine prefills long prompts in chunks; pipelined transfer "
        "needs it (each finished chunk is sent while later chunks compute).",
    )
    scheduling: Literal["generation-first", "context-first"] = Field(
        default="generation-first",
        description="generation-first: the generation server allocates destination blocks "
        "before prefill starts (needed by pipelined transfer); context-first: prefill runs "
        "before the generation server is involved.",
    )
    block_reuse: str = Field(
        default="disabled",
        min_length=1,
        description="KV block reuse policy of the engine: 'disabled', 'all_reusable' or any "
        "other policy name. Pipelined transfer needs 'disabled' or 'all_reusable'.",
        json_schema_extra={"allowed": "a policy name such as 'disabled' or 'all_reusable'"},
    )
    max_beam_width: int = Field(
        default=1, gt=0, description="Largest beam width served; pipelined transfer needs 1."
    )
    cache_kind: Literal["standard", "mla", "mamba-hybrid"] = Field(
        default="standard",
        description="standard: K and V per layer; mla: one latent per layer (kv_factor 1); "
        "mamba-hybrid: attention plus recurrent state (no pipelined transfer).",
    )
    preferred_transceiver_runtime: Literal["CPP", "PYTHON"] | None = Field(
        default=None,
        description="The model's declared preferred transceiver runtime, adopted when "
        "cache_transceiver_config.transceiver_runtime is 'auto'; null: none declared.",
    )
    kv_layout: KvLayoutSpec = Field(
        default_factory=KvLayoutSpec, description="Layout of the engine's KV pool."
    )
    max_seq_len: int | None = Field(
        default=None, gt=0, description="Longest sequence the engine serves; null: unknown."
    )
    kv_memory: Literal["host", "vram"] = Field(
        default="host",
        description="Where the engine keeps its KV pools: host (shared memory) or vram (GPU "
        "memory, shared by CUDA IPC handle or VMM fd). One kind per daemon: a pool of the "
        "other kind is refused at registration. vram needs the NIXL backend, a usable CUDA "
        "device and cupy on the daemon's host, and with the PYTHON runtime a bounce buffer.",
    )
    cuda_device: int = Field(
        default=0,
        ge=0,
        description="The daemon's CUDA device ordinal (as the daemon's own "
        "CUDA_VISIBLE_DEVICES numbers it) for its device staging; used with kv_memory vram.",
    )

    @property
    def kv_factor(self) -> int:
        """Tensors per layer in the cache: 1 for MLA (one latent), else 2 (K and V)."""
        return 1 if self.cache_kind == "mla" else 2


class DaemonSection(BaseModel):
    """The daemon's own identity, addresses and timers."""

    model_config = SECTION_CONFIG

    name: str = Field(
        default="kvxferd",
        pattern=NAME_PATTERN,
        description="Daemon name, used in logs, in the handshake and in the default API "
        "socket path. Letters, digits, '_', '.', '-'.",
    )
    api_socket: str | None = Field(
        default=None,
        min_length=1,
        description="Unix socket on which the engine reaches this daemon; null: "
        "/tmp/kvxferd-<name>.sock.",
    )
    peer_listen: ListenAddress = Field(
        default="127.0.0.1:47400",
        description="host:port of the peer control channel (TCP) other daemons connect to; "
        "port 0 lets the system choose.",
    )
    peers: dict[PeerName, PeerAddress] = Field(
        default_factory=dict,
        description="Static peers: daemon name -> host:port of its peer_listen address.",
    )
    discovery: Literal["static", "etcd"] = Field(
        default="static",
        description="How peer names resolve to addresses: static (daemon.peers) or etcd "
        "(every daemon registers itself under a lease and watches the others; daemon.etcd).",
    )
    etcd: EtcdSection | None = Field(
        default=None,
        description="etcd endpoints, cluster name, lease TTL, TLS and credentials; used with "
        "discovery: etcd and only then.",
    )
    http: ListenAddress | None = Field(
        default="127.0.0.1:9400",
        description="host:port serving /metrics, /healthz, /readyz and the JSON status; "
        "null disables the HTTP server.",
    )
    drain_timeout_ms: int = Field(
        default=30000,
        gt=0,
        description="On SIGTERM, how long in-flight transfers may finish before the daemon "
        "fails them and exits.",
    )
    heartbeat_interval_ms: int = Field(
        default=1000, gt=0, description="How often the daemon sends a heartbeat to each peer."
    )
    heartbeat_timeout_ms: int = Field(
        default=5000,
        gt=0,
        validate_default=True,  # the default must also exceed a configured interval
        description="A peer silent for this long is declared lost; must exceed "
        "heartbeat_interval_ms.",
    )
    handshake_timeout_ms: int = Field(
        default=5000, gt=0, description="Longest wait for a peer handshake to complete."
    )
    shared_secret_file: str | None = Field(
        default=None,
        min_length=1,
        description="File holding the secret peers authenticate with (trailing whitespace "
        "stripped). A relative path is taken relative to the configuration file. "
        "null: peers are not authenticated.",
    )
    tls_cert_file: str | None = Field(
        default=None,
        min_length=1,
        description="PEM certificate this daemon presents to its peers (mutual TLS on the "
        "peer control channel); it must name daemon.name as a DNS subjectAltName. Set with "
        "tls_key_file and tls_ca_file, or none of them. Reloaded on SIGHUP. A relative path "
        "is taken relative to the configuration file. null: no TLS.",
    )
    tls_key_file: str | None = Field(
        default=None,
        min_length=1,
        description="PEM private key of tls_cert_file (unencrypted; keep it mode 0600).",
    )
    tls_ca_file: str | None = Field(
        default=None,
        min_length=1,
        description="PEM CA certificate(s) a peer's certificate must be signed by; both "
        "ends present a certificate (mutual TLS).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="Least severe log level emitted."
    )
    device_zero_copy: bool = Field(
        default=False,
        description="With engine.kv_memory vram: also register the engine's device pools "
        "with NIXL so that peers write into them directly. Off (the default) every byte "
        "goes through the daemon's own device staging, which NIXL can always register; "
        "turn it on only where scripts/gpu-check.sh showed the registration works and is "
        "faster (on an H200, peers wrote into such memory at 0.5 GB/s). A pool whose "
        "registration fails stays copy-only.",
    )
    huge_pages: Literal["auto", "off", "required"] = Field(
        default="auto",
        description="Huge pages for the daemon's own host regions (bounce and staging "
        "buffers): auto uses transparent huge pages where the kernel allows them, else "
        "hugetlb pages where enough are free (vm.nr_hugepages; those are left to the engines' "
        "pools where THP serves), else normal pages (one log line and `kvxferd status` say "
        "which and why); off always takes normal pages; required refuses to start when the "
        "regions cannot be on huge pages. Engine pools choose their own pages "
        "(kvxferd.client.host_pool).",
    )

    cpu_policy: Literal["auto", "batch", "inherit"] = Field(
        default="auto",
        description="The daemon's CPU scheduling policy. batch puts every thread of a daemon "
        "started as SCHED_OTHER on SCHED_BATCH: the same share of the CPU, but its wake-ups "
        "do not preempt the task running on a busy core (more small requests per CPU second, "
        "and no cutting into an engine's slices). auto (the default) does so for the NIXL and "
        "Mooncake backends and leaves UCX and MPI daemons as started: their staged transfers "
        "wait on the daemons' wake-ups and were slower on SCHED_BATCH. A daemon started under "
        "another policy (systemd CPUSchedulingPolicy=, chrt) keeps it. inherit: the policy it "
        "was started with, whatever it is. The log and `kvxferd status` say which applies.",
    )

    max_requests: int = Field(
        default=65536,
        gt=0,
        description="Most receives, and most sends, the daemon keeps at once (each side "
        "counted alone): in progress, finished but not released yet, or (sends) announced by "
        "a peer before the engine's send. A recv or send beyond it is refused with "
        "too_many_requests, a peer's request with overloaded: an engine that never releases "
        "its finished requests, or posts sends nobody asks for, must not exhaust the "
        "daemon's memory (~3 KiB a request). One peer may have at most half of it kept "
        "before the engine sends, so that a receiving daemon that never cancels cannot "
        "take the whole table. Applied on reload (SIGHUP).",
    )
    stall_unhealthy_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a live peer's transport messages may stop arriving (a stalled "
        "peer: MPI's receive queue held up by a process on the host stopped or killed inside "
        "a shared-memory send) before /healthz answers 503 and the systemd watchdog pings "
        "stop, so that the supervisor restarts the daemon. A stall makes the daemon unready "
        "at once; after a kill it never clears without a new process. 0: never unhealthy "
        "for a stall. Applied on reload (SIGHUP).",
    )

    @field_validator("huge_pages", mode="before")
    @classmethod
    def _huge_pages_off(cls, value: object) -> object:
        # YAML reads a bare `off` as false: take it as meant.
        return "off" if value is False else value

    @field_validator("heartbeat_timeout_ms")
    @classmethod
    def _timeout_exceeds_interval(cls, value: int, info: ValidationInfo) -> int:
        interval = info.data.get("heartbeat_interval_ms")
        if interval is not None and value <= interval:
            raise ValueError(
                f"must be greater than heartbeat_interval_ms ({interval}), "
                f"or every peer would be declared lost between two heartbeats (got {value})"
            )
        return value

    @model_validator(mode="after")
    def _tls_all_or_none(self) -> DaemonSection:
        given = [k for k in _TLS_FIELDS if getattr(self, k) is not None]
        if given and len(given) != len(_TLS_FIELDS):
            missing = [k for k in _TLS_FIELDS if k not in given]
            raise ValueError(
                f"mutual TLS needs tls_cert_file, tls_key_file and tls_ca_file together: "
                f"{', '.join(given)} set but {', '.join(missing)} not"
            )
        return self

    @model_validator(mode="after")
    def _discovery_settings(self) -> DaemonSection:
        # Raised as ValueError at the daemon section (pydantic adds no deeper path for a
        # model check), so each message starts with the setting it is about.
        if self.discovery == "static" and self.etcd is not None:
            raise ValueError(
                "etcd: set, but discovery is static (the default), so it would be ignored: "
                "add discovery: etcd, or remove the etcd section"
            )
        if self.discovery == "etcd":
            if self.etcd is None:
                raise ValueError(
                    "discovery: etcd needs an etcd section with at least its endpoints, "
                    "e.g. etcd: {endpoints: ['127.0.0.1:2379']}"
                )
            if self.peers:
                raise ValueError(
                    "peers: static peers and discovery: etcd do not mix (a name would resolve "
                    "two ways): remove daemon.peers, or use discovery: static"
                )
            host, _ = parse_hostport(self.peer_listen)
            if host in WILDCARD_HOSTS and self.etcd.advertise_address is None:
                raise ValueError(
                    f"etcd.advertise_address: needed because peer_listen {self.peer_listen} "
                    "is a wildcard that no peer can dial: set it to this host's address on "
                    "the peers' network (host or host:port)"
                )
        return self

    @property
    def peers_authenticated(self) -> bool:
        """Peers prove who they are: a shared secret, mutual TLS, or both."""
        return self.shared_secret_file is not None or self.tls_cert_file is not None

    def api_socket_path(self) -> str:
        """The engine API socket: `api_socket`, or /tmp/kvxferd-<name>.sock when unset."""
        return self.api_socket if self.api_socket is not None else f"/tmp/kvxferd-{self.name}.sock"

    def peer_listen_hostport(self) -> tuple[str, int]:
        """`peer_listen` split into (host, port); IPv6 hosts come without brackets."""
        return parse_hostport(self.peer_listen)

    def http_hostport(self) -> tuple[str, int] | None:
        """`http` split into (host, port), or None when the HTTP server is disabled."""
        return None if self.http is None else parse_hostport(self.http)

    def peer_hostports(self) -> dict[str, tuple[str, int]]:
        """Static peers as name -> (host, port)."""
        return {name: parse_hostport(addr, min_port=1) for name, addr in self.peers.items()}

    def read_shared_secret(self) -> bytes | None:
        """The peer secret with trailing whitespace removed, or None when no file is set.

        Raises ConfigError naming the file when it cannot be read or holds nothing.
        """
        if self.shared_secret_file is None:
            return None
        path = Path(self.shared_secret_file)
        try:
            secret = path.read_bytes().rstrip()
        except OSError as exc:
            problem = f"daemon.shared_secret_file: cannot read {str(path)!r}: {exc.strerror or exc}"
            raise ConfigError(problem, problems=[problem]) from None
        if not secret:
            problem = (
                f"daemon.shared_secret_file: {str(path)!r} is empty; "
                "put the shared secret in it, or remove the setting to run without one"
            )
            raise ConfigError(problem, problems=[problem])
        return secret
