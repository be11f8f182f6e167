"""The container tests' image: set up once per run with the project's own scripts
(scripts/container-deps.sh installs podman and the rest; scripts/container-build.sh
makes the base image and builds localhost/kvxferd:test, podman's layer cache making a
rebuild seconds). Skipped, saying why, only where containers cannot run at all: not root,
no podman after the set-up script, or no image and no way to build one (PyPI or Debian
unreachable)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from container_harness import IMAGE, REPO, RUN_ID, Pod

BUILD_TIMEOUT_S = 1500


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def image() -> str:
    if os.geteuid() != 0:
        pytest.skip("the container tests need root (rootful podman, the base image)")
    subprocess.run(
        [str(REPO / "scripts" / "container-deps.sh")], timeout=600, check=False
    )  # never fails; says on stderr what it could not install
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed and scripts/container-deps.sh could not install it")
    t0 = time.monotonic()
    build = subprocess.run(
        [str(REPO / "scripts" / "container-build.sh")],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={**os.environ, "IMAGE": IMAGE},
        check=False,
    )
    if build.returncode == 2:
        pytest.skip(f"cannot build the image here: {build.stderr.strip()[-500:]}")
    if build.returncode != 0:
        offline = not _reachable("https://pypi.org/simple/pip/") or not _reachable(
            "http://deb.debian.org/debian/dists/bookworm/Release"
        )
        if offline:
            pytest.skip("the image cannot be built: PyPI or the Debian archive is unreachable")
        pytest.fail(
            f"scripts/container-build.sh exited {build.returncode}:\n"
            + (build.stdout + build.stderr)[-6000:],
            pytrace=False,
        )
    print(f"\nimage {IMAGE} ready in {time.monotonic() - t0:.0f} s\n{build.stdout}")
    return IMAGE


@pytest.fixture
def make_pod(image: str, tmp_path: Path) -> Iterator[Callable[[str], Pod]]:
    """Pods named after the run and the test, all removed at the end of the test."""
    pods: list[Pod] = []
    count = 0

    def make(role: str) -> Pod:
        nonlocal count
        count += 1
        pod = Pod(f"{RUN_ID}-{count}-{role}", tmp_path / f"{count}-{role}")
        pods.append(pod)
        return pod

    try:
        yield make
    finally:
        for pod in pods:
            pod.remove()
