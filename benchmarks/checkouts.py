"""Running `kvxferd <command> --json` from this checkout or another one, for the benchmark
scripts that compare a change with the commit before it in the same passes.

Another checkout (`git worktree add DIR COMMIT`, sharing this .venv) is chosen by running
from its directory with PYTHONPATH set to it: the editable install points at this tree, and
PYTHONPATH comes first on sys.path.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any, TypeVar

T = TypeVar("T")


def kvxferd_json(
    args: list[str],
    tree: str | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> Any:
    """The JSON that `kvxferd *args` prints, run from `tree` (None: this checkout) with
    `env` added to the environment; a non-zero exit stops the script with its stderr."""
    cmd = [sys.executable, "-m", "kvxferd.cli", *args]
    full_env = {**os.environ, **(env or {})}
    if tree is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, full_env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, env=full_env, cwd=tree
    )
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(cmd)} (in {tree or '.'}): exit {done.returncode}\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout)


def cell(stat: dict[str, float] | None) -> str:
    """A table cell: median (min-max), to a precision that suits its size; "-" for none."""
    if stat is None:
        return "-"
    m, lo, hi = stat["median"], stat["min"], stat["max"]
    digits = 0 if m >= 100 else 3 if m < 1 else 2
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def trees(base: str | None) -> list[tuple[str, str | None]]:
    """("this", None) and, with `base`, ("base", its absolute path): the trees measured."""
    return [("this", None)] + ([("base", os.path.abspath(base))] if base else [])


def in_pass(order: list[T], k: int) -> list[T]:
    """`order` in pass k: reversed every other pass, so trees see the same moments."""
    return order if k % 2 == 0 else order[::-1]


def stat(values: list[float]) -> dict[str, float] | None:
    """Median, min and max of `values` (None for none): what `cell` shows."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
