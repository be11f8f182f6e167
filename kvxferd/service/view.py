"""What the daemon's operational parts see of it: status, reload, metrics, the systemd
summary and the engine and peer handlers read (and reload writes) these attributes and no
others. `Daemon` satisfies this structurally; none of those modules imports it, so the
composition root depends on them and never the other way round."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvxferd.api.server import ApiServer
    from kvxferd.config import KvxferdConfig, ResolvedSettings
    from kvxferd.discovery import Discovery
    from kvxferd.peers.handshake import Identity
    from kvxferd.peers.manager import PeerManager
    from kvxferd.service.loopmon import LoopMonitor
    from kvxferd.service.metrics import DaemonMetrics
    from kvxferd.service.pools import PoolRegistry
    from kvxferd.service.reload import ReloadReport
    from kvxferd.service.sdnotify import Notifier
    from kvxferd.transceiver.admission import AdmissionWindow
    from kvxferd.transceiver.bounce import BounceBuffers
    from kvxferd.transceiver.dataplane import DataPlane
    from kvxferd.transceiver.receiver import Receiver
    from kvxferd.transceiver.sender import Sender


class DaemonView(Protocol):
    # Written by a reload.
    cfg: KvxferdConfig
    settings: ResolvedSettings
    last_reload: ReloadReport | None

    # Read only.
    @property
    def daemon_name(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def incarnation(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def identity(self) -> Identity: ...
    @property
    def secret_configured(self) -> bool: ...
    @property
    def staged(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    @property
    def serving(self) -> bool: ...
    def stalled_peers(self) -> dict[str, float]: ...
    @property
    def draining(self) -> bool: ...
    @property
    def sender(self) -> Sender: ...
    @property
    def receiver(self) -> Receiver: ...
    @property
    def admission(self) -> AdmissionWindow: ...
    @property
    def pools(self) -> PoolRegistry: ...
    @property
    def peers(self) -> PeerManager: ...
    @property
    def discovery(self) -> Discovery: ...
    @property
    def api(self) -> ApiServer: ...
    @property
    def bounce(self) -> BounceBuffers | None: ...
    @property
    def dataplane(self) -> DataPlane: ...
    @property
    def device(self) -> dict[str, object] | None: ...
    @property
    def metrics(self) -> DaemonMetrics: ...
    @property
    def notifier(self) -> Notifier: ...
    @property
    def loop_monitor(self) -> LoopMonitor: ...
