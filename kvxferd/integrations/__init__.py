"""Integrations of kvxferd with inference engines (vLLM: kvxferd.integrations.vllm).

Each engine's integration lives in its own subpackage and imports that engine only where it
is used, so that kvxferd itself (the daemon, the client) never needs the engine installed.
"""
