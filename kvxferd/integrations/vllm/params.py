"""`kv_transfer_params`: how a router tells the two vLLM instances which transfer is theirs.

A router (kvxferd.integrations.vllm.proxy is one) gives every disaggregated request a transfer
id, unique across the deployment, and sends the same prompt to both instances:

* to the prefill (context) instance, with `max_tokens` 1:
  `{"do_remote_decode": true, "kvxferd": {"transfer_id": ID, "peer": GEN}}`, GEN (optional)
  being the name the decode instance's daemon announces (its `daemon.name`): the context
  daemon then serves that daemon only, and refuses any other that asks for the transfer id
  (`not_your_request`); without it, whoever asks first is served
* to the decode (generation) instance:
  `{"do_remote_prefill": true, "kvxferd": {"transfer_id": ID, "peer": PEER}}`, PEER being the
  prefill instance's kvxferd daemon (its HOST:PORT, or a static peer name of the decode
  daemon's config); without "peer", the decode connector's `kv_connector_extra_config`
  "peer" is used.

Both may go at once: the decode instance posts its receive as soon as its blocks are
allocated, and the prefill instance's daemon writes into them once the prompt's KV is
complete. The transfer id travels inside the params because vLLM gives each instance's
request an id of its own. `do_remote_prefill` / `do_remote_decode` are the names vLLM itself
and its NIXL connector use, so vLLM's KV-transfer metrics count these requests.

Parsing never raises into vLLM's scheduler (an exception there kills the engine): a
malformed entry becomes a `ParamsError` the connector turns into that one request's failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# The daemon's request ids: printable, no whitespace, bounded (they name log lines).
_TRANSFER_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


class ParamsError(ValueError):
    """A request's kv_transfer_params are not what the connector understands."""


@dataclass(frozen=True)
class Transfer:
    """What one request's params ask of this instance."""

    transfer_id: str
    peer: str = ""  # decode side: the context daemon to receive from ("": the default)


def _section(params: Any) -> dict[str, Any] | None:
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    section = params.get("kvxferd")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ParamsError(
            f'kv_transfer_params["kvxferd"] must be an object, got {type(section).__name__}'
        )
    return section


def _transfer(section: dict[str, Any], flag: str) -> Transfer:
    tid = section.get("transfer_id")
    if not isinstance(tid, str) or not _TRANSFER_ID.fullmatch(tid):
        raise ParamsError(
            f'{flag} needs kv_transfer_params["kvxferd"]["transfer_id"]: 1-128 characters '
            f"of A-Z a-z 0-9 _ . : @ -, got {str(tid)[:40]!r}"
        )
    peer = section.get("peer", "")
    if not isinstance(peer, str) or len(peer) > 256 or any(c.isspace() for c in peer):
        raise ParamsError(
            f'kv_transfer_params["kvxferd"]["peer"] must be HOST:PORT or a peer name, '
            f"got {str(peer)[:40]!r}"
        )
    return Transfer(tid, peer)


def _wanted(params: Any, flag: str) -> Transfer | None:
    """The transfer `flag` asks for; None when the request does not ask for one."""
    if not isinstance(params, dict) or not params.get(flag):
        if params is not None and not isinstance(params, dict):
            raise ParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
        return None
    section = _section(params)
    if section is None:
        raise ParamsError(f'{flag} needs kv_transfer_params["kvxferd"] with a transfer_id')
    return _transfer(section, flag)


def remote_prefill(params: Any) -> Transfer | None:
    """Decode side: the transfer to receive this request's prompt KV from, if any."""
    return _wanted(params, "do_remote_prefill")


def remote_decode(params: Any) -> Transfer | None:
    """Prefill side: the transfer to send this request's prompt KV to, if any."""
    return _wanted(params, "do_remote_decode")


def prefill_reply(transfer: Transfer, num_tokens: int, peer: str) -> dict[str, Any]:
    """The params a prefill instance returns: what the decode request needs (a router that
    sent both at once may ignore it; one that sends them in turn passes it on)."""
    section: dict[str, Any] = {"transfer_id": transfer.transfer_id, "num_tokens": num_tokens}
    if peer:
        section["peer"] = peer
    return {"do_remote_prefill": True, "do_remote_decode": False, "kvxferd": section}
