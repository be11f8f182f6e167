#!/usr/bin/env python3
"""Mutation score of the pure modules against their fast unit tests (issue 13).

For each module: parse it with `ast`, enumerate mutation sites, sample up to --max mutants
(seeded), write each mutant over a temporary copy of the repository (the real files are
never touched), run that module's unit tests there with a timeout, and count a mutant as
killed when the tests fail (or time out), as survived when they pass.

Mutation operators: comparison flips (< <=, > >=, == !=, is / is not, in / not in), + <-> -,
* -> //, // -> *, and <-> or, removing a `not`, negating the test of an if / while / ternary
/ assert, integer constants +1 and -1, True <-> False, `return x` -> `return None`,
+= <-> -=, and deleting a statement (replaced by `pass`). Not mutated: docstrings, the
expressions inside f-strings (error message text), annotations, imports and `__all__`.
Mutants whose source equals the original's, or another mutant's, are dropped.

Usage (from the repository root, with the project's venv):

    .venv/bin/python scripts/mutation_score.py                  # all five modules
    .venv/bin/python scripts/mutation_score.py plan admission   # some of them
    .venv/bin/python scripts/mutation_score.py --max 150 --seed 13 --jobs 2 -v

-v lists the surviving mutants (line and what changed). The exit status is 1 when a module
scores below --fail-under (default 85).
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# module name -> (source path, unit test files)
MODULES: dict[str, tuple[str, list[str]]] = {
    "plan": ("kvxferd/transceiver/plan.py", ["tests/transceiver/test_plan_units.py"]),
    "admission": (
        "kvxferd/transceiver/admission.py",
        ["tests/transceiver/test_admission_units.py"],
    ),
    "framing": ("kvxferd/peers/framing.py", ["tests/peers/test_framing_units.py"]),
    "heads": ("kvxferd/memory/heads.py", ["tests/memory/test_heads_units.py"]),
    "layout": ("kvxferd/memory/layout.py", ["tests/memory/test_layout_units.py"]),
}

_CMP_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BIN_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
}


@dataclass(frozen=True)
class Site:
    index: int
    line: int
    what: str


class _Mutator(ast.NodeTransformer):
    """Walks the tree in a fixed order, numbering mutation sites; applies site `target`.

    With target -1 it only records the sites.
    """

    def __init__(self, target: int = -1) -> None:
        self.target = target
        self.count = 0
        self.sites: list[Site] = []
        self.applied: Site | None = None

    def _site(self, node: ast.AST, what: str) -> bool:
        site = Site(self.count, getattr(node, "lineno", 0), what)
        self.sites.append(site)
        self.count += 1
        if site.index == self.target:
            self.applied = site
            return True
        return False

    # -- things left alone -------------------------------------------------------------------

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        return node

    def visit_Import(self, node: ast.Import) -> ast.AST:
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for i, stmt in enumerate(body):
            docstring = (
                i == 0
                and isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            )
            if docstring or _is_all(stmt) or isinstance(stmt, ast.Import | ast.ImportFrom):
                out.append(stmt)
                continue
            deletable = isinstance(
                stmt, ast.Expr | ast.Assign | ast.AugAssign | ast.Raise | ast.Return | ast.If
            ) and not (isinstance(stmt, ast.Return) and stmt.value is None)
            if deletable and self._site(stmt, "delete statement"):
                out.append(ast.copy_location(ast.Pass(), stmt))
                continue
            new = self.visit(stmt)
            out.append(new)
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field, old in ast.iter_fields(node):
            if field in ("returns", "annotation", "type_comment", "decorator_list"):
                continue
            if isinstance(old, list) and old and isinstance(old[0], ast.stmt):
                setattr(node, field, self._body(old))
            elif isinstance(old, list):
                new_items = []
                for item in old:
                    if isinstance(item, ast.AST):
                        item = self.visit(item)
                    new_items.append(item)
                setattr(node, field, new_items)
            elif isinstance(old, ast.AST):
                setattr(node, field, self.visit(old))
        return node

    # -- the operators -----------------------------------------------------------------------

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        for i, op in enumerate(node.ops):
            swap = _CMP_SWAP.get(type(op))
            if swap is not None and self._site(node, f"{type(op).__name__} -> {swap.__name__}"):
                node.ops[i] = swap()
        return self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        swap = _BIN_SWAP.get(type(node.op))
        if swap is not None and self._site(node, f"{type(node.op).__name__} -> {swap.__name__}"):
            node.op = swap()
        return self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST:
        swap = {ast.Add: ast.Sub, ast.Sub: ast.Add}.get(type(node.op))  # type: ignore[call-overload]
        if swap is not None and self._site(node, f"{type(node.op).__name__}= -> {swap.__name__}="):
            node.op = swap()
        return self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        other = ast.Or if isinstance(node.op, ast.And) else ast.And
        if self._site(node, f"{type(node.op).__name__} -> {other.__name__}"):
            node.op = other()
        return self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        if isinstance(node.op, ast.Not) and self._site(node, "remove not"):
            return self.visit(node.operand)
        return self.generic_visit(node)

    def _negate_test(self, node: ast.If | ast.While | ast.IfExp | ast.Assert) -> None:
        if self._site(node, f"negate {type(node).__name__} test"):
            node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)

    def visit_If(self, node: ast.If) -> ast.AST:
        self._negate_test(node)
        return self.generic_visit(node)

    def visit_While(self, node: ast.While) -> ast.AST:
        self._negate_test(node)
        return self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        self._negate_test(node)
        return self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        self._negate_test(node)
        return self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        value = node.value
        if isinstance(value, bool):
            if self._site(node, f"{value} -> {not value}"):
                return ast.copy_location(ast.Constant(not value), node)
        elif isinstance(value, int):
            if self._site(node, f"{value} -> {value + 1}"):
                return ast.copy_location(ast.Constant(value + 1), node)
            if self._site(node, f"{value} -> {value - 1}"):
                return ast.copy_location(ast.Constant(value - 1), node)
        return node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        returns_something = node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None
        )
        if returns_something and self._site(node, "return None"):
            node.value = ast.Constant(None)
            return node
        return self.generic_visit(node)


def _is_all(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets
    )


def sites(tree: ast.Module) -> list[Site]:
    m = _Mutator()
    m.visit(copy.deepcopy(tree))
    return m.sites


def mutant(tree: ast.Module, index: int) -> tuple[str, Site]:
    m = _Mutator(index)
    new = m.visit(copy.deepcopy(tree))
    ast.fix_missing_locations(new)
    assert m.applied is not None
    return ast.unparse(new), m.applied


@dataclass
class Workspace:
    root: Path

    @classmethod
    def create(cls, base: Path, name: str) -> Workspace:
        root = base / name
        shutil.copytree(
            REPO / "kvxferd", root / "kvxferd", ignore=shutil.ignore_patterns("__pycache__")
        )
        shutil.copytree(
            REPO / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__")
        )
        shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
        return cls(root)

    def run_tests(self, tests: list[str], timeout: float) -> tuple[str, float]:
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(self.root))
        env.pop("PYTHONPYCACHEPREFIX", None)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "--timeout",
            str(int(timeout) + 5),
            *tests,
        ]
        started = time.monotonic()
        try:
            proc = subprocess.run(
                cmd,
                cwd=self.root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - started
        status = "passed" if proc.returncode == 0 else f"failed({proc.returncode})"
        if proc.returncode not in (0, 1):
            # 2: interrupted/collection error, 3: internal error, 4: usage: still killed,
            # but keep the tail for -v.
            status += ": " + proc.stdout.decode(errors="replace")[-300:].replace("\n", " | ")
        return status, time.monotonic() - started


def _check_workspace(ws: Workspace) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import kvxferd; print(kvxferd.__file__)"],
        cwd=ws.root,
        env=dict(os.environ, PYTHONPATH=str(ws.root), PYTHONDONTWRITEBYTECODE="1"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(out).resolve().is_relative_to(ws.root.resolve()):
        sys.exit(f"the copy's tests would import kvxferd from {out}, not from {ws.root}")


def score_module(
    name: str, base: Path, args: argparse.Namespace
) -> tuple[int, int, list[tuple[Site, str]]]:
    src_rel, tests = MODULES[name]
    original = (REPO / src_rel).read_text()
    tree = ast.parse(original)
    all_sites = sites(tree)
    baseline_src = ast.unparse(tree)
    seen = {baseline_src}
    candidates: list[tuple[str, Site]] = []
    for site in all_sites:
        src, applied = mutant(tree, site.index)
        if src in seen:
            continue
        seen.add(src)
        candidates.append((src, applied))
    rng = random.Random(f"{args.seed}:{name}")
    if len(candidates) > args.max:
        candidates = rng.sample(candidates, args.max)
        candidates.sort(key=lambda c: c[1].index)

    workspaces = [Workspace.create(base, f"{name}-{j}") for j in range(args.jobs)]
    _check_workspace(workspaces[0])
    # Baseline: the unparsed original must pass (it is what every mutant differs from).
    for ws in workspaces:
        (ws.root / src_rel).write_text(baseline_src)
    status, took = workspaces[0].run_tests(tests, timeout=600)
    if status != "passed":
        sys.exit(f"{name}: the unit tests fail on the unmutated module ({status})")
    timeout = max(30.0, 5 * took)
    print(
        f"{name}: {len(all_sites)} sites, {len(candidates)} distinct mutants run "
        f"(baseline {took:.1f}s, timeout {timeout:.0f}s)",
        flush=True,
    )

    def run_one(job: int, batch: list[tuple[str, Site]]) -> Iterator[tuple[Site, str]]:
        ws = workspaces[job]
        for src, site in batch:
            (ws.root / src_rel).write_text(src)
            status, _ = ws.run_tests(tests, timeout)
            yield site, status
        (ws.root / src_rel).write_text(baseline_src)

    batches = [candidates[j :: args.jobs] for j in range(args.jobs)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = [
            r for rs in pool.map(lambda jb: list(run_one(*jb)), enumerate(batches)) for r in rs
        ]
    survived = [(site, status) for site, status in results if status == "passed"]
    killed = len(results) - len(survived)
    return killed, len(results), survived


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"some of {', '.join(MODULES)} (default: all)")
    parser.add_argument("--max", type=int, default=150, help="mutants per module at most")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--fail-under", type=float, default=85.0)
    parser.add_argument("-v", "--verbose", action="store_true", help="list the survivors")
    args = parser.parse_args()
    args.modules = args.modules or list(MODULES)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}: choose from {', '.join(MODULES)}")
    summary: list[tuple[str, int, int]] = []
    with tempfile.TemporaryDirectory(prefix="kvxferd-mutants-") as tmp:
        for name in args.modules:
            killed, total, survived = score_module(name, Path(tmp), args)
            summary.append((name, killed, total))
            print(
                f"{name}: {killed}/{total} killed = {100 * killed / max(total, 1):.1f}%", flush=True
            )
            if args.verbose:
                src_rel = MODULES[name][0]
                lines = (REPO / src_rel).read_text().splitlines()
                for site, _ in survived:
                    text = lines[site.line - 1].strip() if 0 < site.line <= len(lines) else ""
                    print(f"  survived {src_rel}:{site.line}: {site.what}    {text}")
    print("\nmodule      killed/total  score")
    failed = False
    for name, killed, total in summary:
        pct = 100 * killed / max(total, 1)
        failed |= pct < args.fail_under
        print(f"{name:<11} {killed:>4}/{total:<7}  {pct:5.1f}%")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
