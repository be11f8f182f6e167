"""The discovery a configuration asks for."""

from __future__ import annotations

from kvxferd import __version__
from kvxferd.config import KvxferdConfig
from kvxferd.discovery.base import Discovery
from kvxferd.discovery.static import StaticDiscovery


def make_discovery(cfg: KvxferdConfig, incarnation: str) -> Discovery:
    """Static over daemon.peers, or etcd (imported only then: aetcd is an optional extra)."""
    d = cfg.daemon
    if d.discovery == "static" or d.etcd is None:
        return StaticDiscovery(dict(d.peers))
    from kvxferd.discovery.etcd import EtcdDiscovery, Me

    me = Me(
        name=d.name,
        role=cfg.engine.role,
        incarnation=incarnation,
        tp_rank=d.etcd.tp_rank,
        tp_size=cfg.engine.tensor_parallel_size,
        version=__version__,
    )
    return EtcdDiscovery(d.etcd, me)
