"""The image as built (scripts/container-build.sh), inspected without a daemon: the user,
ports, entry point, health check and stop signal it declares; what its final stage holds
(every backend importable, no compilers, no pip caches); its size."""

from __future__ import annotations

import json
from typing import Any

import pytest
from container_harness import UID, podman

pytestmark = pytest.mark.timeout(1800)  # the first test builds the image (minutes, once)

# The image of every backend stays under this: a regression (a CUDA wheel pulled in,
# a cache left behind) shows up here first.
MAX_IMAGE_BYTES = 2_000_000_000


def _inspect(image: str) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(podman("image", "inspect", image).stdout)[0]
    return info


def test_image_declares_user_ports_entrypoint_healthcheck(image: str) -> None:
    info = _inspect(image)
    config = info["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert set(config["ExposedPorts"]) == {"47400/tcp", "9400/tcp"}
    assert config["Entrypoint"] == ["kvxferd", "run"]
    assert config["Cmd"] == ["--config", "/etc/kvxferd/kvxferd.yaml"]
    assert config.get("StopSignal") == "SIGTERM"
    health = info.get("Healthcheck") or info.get("HealthCheck") or config.get("Healthcheck")
    assert health, "no health check (the OCI format drops it: build with --format docker)"
    assert "/healthz" in " ".join(health["Test"]) or "KVXFERD_HEALTH_URL" in " ".join(
        health["Test"]
    )
    assert any(e.startswith("KVXFERD_HEALTH_URL=http://127.0.0.1:9400/") for e in config["Env"])
    assert info["Size"] < MAX_IMAGE_BYTES, f"image is {info['Size'] / 1e6:.0f} MB"


# Run inside the image as its own user: what the final stage holds.
_PROBE = r"""
import glob, importlib, json, os, shutil
out = {"uid": os.getuid(), "gid": os.getgid()}
out["tools"] = {t: shutil.which(t) for t in ("gcc", "cc", "c++", "g++", "make", "ld", "as")}
out["caches"] = [p for pat in ("/root/.cache/pip", "/home/*/.cache/pip", "/tmp/pip-*",
                               "/var/cache/apt/archives/*.deb", "/var/lib/apt/lists/*_Packages")
                 for p in glob.glob(pat)]
out["imports"] = {}
for m in ("nixl_cu12", "ucxx", "mpi4py", "mooncake.engine", "kvxferd", "numpy"):
    try:
        importlib.import_module(m)
        out["imports"][m] = "ok"
    except Exception as exc:
        out["imports"][m] = repr(exc)
out["mpiexec"] = shutil.which("mpiexec")
print(json.dumps(out))
"""


def test_final_stage_has_every_backend_and_no_build_tools(image: str) -> None:
    run = podman(
        "run", "--rm", "--read-only", "--health-interval", "disable",
        "--entrypoint", "python", image, "-c", _PROBE,
        timeout=120,
    )  # fmt: skip
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert (probe["uid"], probe["gid"]) == (UID, UID)
    assert probe["imports"] == dict.fromkeys(probe["imports"], "ok"), probe["imports"]
    assert probe["mpiexec"], "the MPICH wheel's mpiexec is not on PATH"
    assert not any(probe["tools"].values()), probe["tools"]
    assert probe["caches"] == [], probe["caches"]


def test_kvxferd_runs_in_the_image(image: str) -> None:
    version = podman(
        "run", "--rm", "--health-interval", "disable", "--entrypoint", "kvxferd", image,
        "--version",
    )  # fmt: skip
    assert version.stdout.strip().startswith("kvxferd"), version.stdout
    # The example configurations shipped in the image validate there.
    check = podman(
        "run", "--rm", "--health-interval", "disable", "--entrypoint", "kvxferd", image,
        "config", "validate", "/usr/share/doc/kvxferd/examples/context.yaml",
        timeout=120, check=False,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
