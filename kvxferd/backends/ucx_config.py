"""The settings a backend's UCX runs with, asked of that UCX itself.

Whether UCX may move a write with CMA (kvxferd.backends.cma) depends on UCX_TLS,
UCX_SHM_DEVICES and UCX_MODULES, which UCX takes from the environment or from any of the
ucx.conf files it reads (its build's directory, beside its library, $HOME,
$UCX_CONFIG_DIR, the working directory; "KEY=VALUE" or "KEY: VALUE", continuation lines,
sections filtered by CPU or machine). Rather than imitate that, this asks the library:
ucp_config_read + ucp_config_print (UCX_TLS, UCX_SHM_DEVICES) and
ucs_global_opts_get_value (MODULES, read once when the library loads), through ctypes, of
the copy the backend loads: NIXL's wheels vendor their own UCX (nixl_cu12.libs), ucxx
uses the libucx wheel's. dlopen of a library the backend has loaded already returns it.
Anything that cannot be asked answers None, which the caller takes as "no CMA" (a drain
instead of a cancel: slower, never unsafe).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from pathlib import Path

log = logging.getLogger("kvxferd.backends")

# Where each backend's UCX lives: (package, its libraries' directory relative to the
# package, the file name patterns of libucp and libucs there).
_LIBS: dict[str, list[tuple[str, str, str, str]]] = {
    "NIXL": [
        ("nixl_cu12", "../nixl_cu12.libs", "libucp-*.so*", "libucs-*.so*"),
        ("nixl_cu13", "../nixl_cu13.libs", "libucp-*.so*", "libucs-*.so*"),
    ],
    "UCX": [("libucx", "lib", "libucp.so*", "libucs.so*")],
}
_PRINT_CONFIG = 1  # UCS_CONFIG_PRINT_CONFIG
Settings = dict[str, str]


def loaded_libraries(maps: str = "/proc/self/maps") -> list[tuple[Path, Path]]:
    """(libucp, libucs) of each UCX copy this process has mapped (one directory each):
    a backend built against a UCX of the system rather than a wheel's."""
    by_dir: dict[Path, dict[str, Path]] = {}
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                _, slash, rest = line.rstrip("\n").partition("/")
                path = Path(slash + rest.removesuffix(" (deleted)"))
                for kind in ("libucp", "libucs"):
                    if slash and path.name.startswith(kind) and "signal" not in path.name:
                        by_dir.setdefault(path.parent, {}).setdefault(kind, path)
    except OSError:
        return []
    return [(d["libucp"], d["libucs"]) for d in by_dir.values() if len(d) == 2]


def libraries(backend: str) -> list[tuple[Path, Path]]:
    """(libucp, libucs) of each UCX copy `backend` may load, from the installed wheels;
    when no wheel has one, the copies this process has mapped."""
    found = []
    for package, rel, ucp_glob, ucs_glob in _LIBS.get(backend, []):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            libdir = (Path(location) / rel).resolve()
            ucp = sorted(libdir.glob(ucp_glob))
            ucs = sorted(p for p in libdir.glob(ucs_glob) if "signal" not in p.name)
            if ucp and ucs:
                found.append((ucp[0].resolve(), ucs[0].resolve()))
    if not found and backend in _LIBS:
        found = loaded_libraries()
    return found


def _printed_config(ucp: ctypes.CDLL, libc: ctypes.CDLL) -> str | None:
    config = ctypes.c_void_p()
    ucp.ucp_config_read.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    ucp.ucp_config_read.restype = ctypes.c_int
    if ucp.ucp_config_read(None, None, ctypes.byref(config)) != 0:
        return None
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    try:
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if not stream:
            return None
        ucp.ucp_config_print.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        ucp.ucp_config_print.restype = None
        ucp.ucp_config_print(config, stream, None, _PRINT_CONFIG)
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.fclose(stream)
        if not buf.value:
            return ""
        return ctypes.string_at(buf.value, size.value).decode(errors="replace")
    finally:
        if buf.value:
            libc.free.argtypes = [ctypes.c_void_p]
            libc.free(buf)
        ucp.ucp_config_release.argtypes = [ctypes.c_void_p]
        ucp.ucp_config_release(config)


def ask(ucp_path: Path, ucs_path: Path) -> Settings | None:
    """TLS, SHM_DEVICES and MODULES as this UCX copy takes them; None if it cannot say."""
    try:
        ucs = ctypes.CDLL(str(ucs_path))
        ucp = ctypes.CDLL(str(ucp_path))
        libc = ctypes.CDLL(None)
        text = _printed_config(ucp, libc)
        get = ucs.ucs_global_opts_get_value
        get.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        get.restype = ctypes.c_int
        modules = ctypes.create_string_buffer(4096)
        if text is None or get(b"MODULES", modules, len(modules)) != 0:
            return None
    except (OSError, AttributeError) as exc:  # not loadable, or a UCX without these calls
        log.warning("could not ask UCX (%s) for its settings: %s", ucp_path, exc)
        return None
    settings = {"MODULES": modules.value.decode(errors="replace")}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name in ("UCX_TLS", "UCX_SHM_DEVICES"):
            settings[name.removeprefix("UCX_")] = value.strip()
    return settings if {"TLS", "SHM_DEVICES"} <= settings.keys() else None


def backend_settings(backend: str) -> list[Settings | None]:
    """The settings of every UCX copy `backend` may load (None: one that could not say);
    [] for a backend that does not use UCX, or whose UCX is not installed."""
    return [ask(ucp, ucs) for ucp, ucs in libraries(backend)]
