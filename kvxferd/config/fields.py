"""Pieces every configuration section uses: the strict model config, the name pattern and
the one host:port parser with operator-facing errors."""

from __future__ import annotations

import ipaddress
import re

from pydantic import ConfigDict

# Strict: YAML already yields typed values, so "60000" (a string) or `true` for an
# integer field is almost certainly a mistake and is reported, not coerced.
SECTION_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)

NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")


def parse_hostport(value: str, *, min_port: int = 0) -> tuple[str, int]:
    """Split "host:port" ("[v6addr]:port" for IPv6) and check both parts.

    Raises ValueError with an operator-facing message; pydantic turns it into a
    validation error at the field's path.
    """
    allowed = f"host:port with a port from {min_port} to 65535, e.g. 127.0.0.1:47400"
    if value.startswith("["):
        close = value.find("]:")
        if close < 0:
            raise ValueError(f"must be {allowed} (got {value!r})")
        host, port_text = value[1:close], value[close + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"{host!r} in brackets is not an IPv6 address (got {value!r})"
            ) from None
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep or not host:
            raise ValueError(f"must be {allowed} (got {value!r})")
        if ":" in host:
            raise ValueError(f"write an IPv6 address in brackets, e.g. [::1]:47400 (got {value!r})")
        if not _HOSTNAME.match(host):
            raise ValueError(f"{host!r} is not a valid host name or address (got {value!r})")
    if not port_text.isdigit() or not min_port <= int(port_text) <= 65535:
        raise ValueError(f"must be {allowed} (got {value!r})")
    return host, int(port_text)
