"""How the tests run the `kvxferd` command line: `python -m kvxferd.cli`, in this
interpreter, as the installed script would.

Imported as a top-level module (`from cli_harness import kvxferd`): tests/ has no
__init__.py and holds the suite's conftest.py, so pytest puts it on sys.path.
"""

from __future__ import annotations

import os
import subprocess
import sys

KVXFERD = [sys.executable, "-m", "kvxferd.cli"]


def kvxferd(
    *args: str, timeout: float, env: dict[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvxferd ARGS` run to completion, its output captured as text; `env` is added
    to this process's environment."""
    return subprocess.run(
        [*KVXFERD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
        cwd=cwd,
        check=False,
    )
