"""The NIXL module the daemons load here, for the tests that need it: nixl-cu12 on the CPU
hosts, nixl-cu13 on the GPU machine (kvxferd.backends.nixl.nixl_module_name picks as the
daemon does). A test that asked for nixl_cu12 by name skipped, or broke its directory's
collection, where only nixl-cu13 is installed."""

from __future__ import annotations

from types import ModuleType

import pytest

from kvxferd.backends.nixl import nixl_module_name

_WHY = "NIXL is not installed (scripts/install.sh)"


def nixl_or_skip(reason: str = _WHY) -> ModuleType:
    """The NIXL module, imported; else skip (the whole module when called at its top)."""
    name = nixl_module_name()
    if name is None:
        pytest.skip(reason, allow_module_level=True)
    return pytest.importorskip(name, reason=reason)
