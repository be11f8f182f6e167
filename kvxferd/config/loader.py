"""Read a configuration file into a `KvxferdConfig`, or explain why it cannot be.

Files are parsed with `yaml.safe_load` (never a loader that can build Python
objects). A second, construction-free pass (`yaml.compose`) records the line of
every key, so that problems can name it, and finds duplicate keys, which
safe_load would silently collapse to the last one.

Two kinds of file are accepted:

* a kvxferd file: optional top-level sections `cache_transceiver_config:`,
  `engine:` and `daemon:`; an empty file, or an empty section, means defaults;
* a TensorRT-LLM disaggregated-serving file (`context_servers:` and/or
  `generation_servers:` at top level), read for one role (see trtllm.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from kvxferd.config import trtllm
from kvxferd.config.diagnostics import Loc, dotted, format_validation_error, show
from kvxferd.config.discovery import ETCD_FILE_FIELDS
from kvxferd.config.model import KvxferdConfig
from kvxferd.errors import ConfigError
from kvxferd.peers import tls

# Daemon-section settings that name files.
_DAEMON_FILES = ("shared_secret_file", *tls.FIELDS)

ROLES = ("context", "generation", "both")
SECTIONS = ("cache_transceiver_config", "engine", "daemon")


@dataclass
class _Document:
    source: str
    data: dict[object, object]
    base_dir: Path
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    duplicates: list[tuple[Loc, int, int]] = field(default_factory=list)

    def line_of(self, loc: Loc) -> int | None:
        return self.lines.get(tuple(str(part) for part in loc))

    def problem(self, loc: Loc, message: str) -> str:
        line = self.line_of(loc) if loc else None
        where = f" (line {line})" if line else ""
        return (
            f"{self.source}: {dotted(loc)}: {message}{where}"
            if loc
            else (f"{self.source}: {message}")
        )


def _fail(source: str, problems: list[str]) -> ConfigError:
    count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
    return ConfigError(f"{source}: invalid configuration ({count})", problems)


def _parse(text: str, source: str, base_dir: Path) -> _Document:
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise _fail(source, [_syntax_problem(exc, source)]) from None
    if data is None:
        data = {}  # an empty (or comment-only) file: all defaults
    if not isinstance(data, dict):
        raise _fail(
            source,
            [
                f"{source}: the file must hold a mapping of sections "
                f"(cache_transceiver_config:, engine:, daemon:), not {show(data)}"
            ],
        )
    doc = _Document(source=source, data=data, base_dir=base_dir)
    if root is not None:
        _index(root, (), doc, set())
    return doc


def _syntax_problem(exc: yaml.YAMLError, source: str) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    context_mark = getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        context += f" that starts at line {context_mark.line + 1}, column {context_mark.column + 1}"
    detail = f"{problem} ({context})" if context else str(problem)
    if mark is not None:
        return (
            f"{source}: YAML syntax error at line {mark.line + 1}, "
            f"column {mark.column + 1}: {detail}"
        )
    return f"{source}: YAML syntax error: {detail}"


def _index(node: yaml.Node, loc: tuple[str, ...], doc: _Document, seen: set[int]) -> None:
    if id(node) in seen:  # an alias that refers back to an enclosing node
        return
    seen = seen | {id(node)}
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in first:
                doc.duplicates.append(((*loc, key), first[key], line))
            else:
                first[key] = line
            here = (*loc, key)
            doc.lines[here] = line
            _index(value_node, here, doc, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _index(item, (*loc, str(index)), doc, seen)


def _duplicate_problems(doc: _Document, relevant: tuple[Loc, ...] | None = None) -> list[str]:
    """Duplicate keys at or under the `relevant` locations (None: anywhere)."""
    out = []
    for loc, first, again in doc.duplicates:
        if relevant is not None and not any(
            loc[: len(p)] == p or loc == p[: len(loc)] for p in relevant
        ):
            continue  # a part of a TensorRT-LLM file kvxferd does not read
        out.append(
            f"{doc.source}: {dotted(loc)}: duplicate key {str(loc[-1])!r} (lines {first} and "
            f"{again}); YAML keeps only the last one, so remove one of them"
        )
    return out


def _check_role(role: str | None, source: str) -> None:
    if role is not None and role not in ROLES:
        raise _fail(source, [f"{source}: role must be one of {', '.join(ROLES)} (got {role!r})"])


def _finish(cfg: KvxferdConfig, doc: _Document, paths: Mapping[str, str]) -> KvxferdConfig:
    """Attach the source and check what can only be checked outside the model."""
    # Files named by the daemon section are relative to the configuration file.
    relative = {
        key: str(doc.base_dir / value)
        for key in _DAEMON_FILES
        if (value := getattr(cfg.daemon, key)) is not None and not os.path.isabs(value)
    }
    if relative:
        cfg = cfg.model_copy(update={"daemon": cfg.daemon.model_copy(update=relative)})
    etcd = cfg.daemon.etcd
    if etcd is not None:
        # The same rule for the etcd section's files.
        etcd_relative = {
            key: str(doc.base_dir / value)
            for key in ETCD_FILE_FIELDS
            if (value := getattr(etcd, key)) is not None and not os.path.isabs(value)
        }
        if etcd_relative:
            etcd = etcd.model_copy(update=etcd_relative)
            cfg = cfg.model_copy(update={"daemon": cfg.daemon.model_copy(update={"etcd": etcd})})
    try:
        cfg.daemon.read_shared_secret()
        tls.load(cfg.daemon)  # unreadable or mismatched files fail here, not at start
        if etcd is not None:
            etcd.read_password()
            etcd.read_tls()
    except ConfigError as exc:
        raise _fail(
            doc.source,
            [_file_problem(doc, p) for p in exc.problems],
        ) from None
    if etcd is not None and etcd.tp_rank >= cfg.engine.tensor_parallel_size:
        problem = (
            f"must be below engine.tensor_parallel_size ({cfg.engine.tensor_parallel_size}), "
            f"as ranks count from 0 (got {etcd.tp_rank})"
        )
        raise _fail(doc.source, [doc.problem(("daemon", "etcd", "tp_rank"), problem)])
    return cfg.with_source(doc.source, paths)


def _file_problem(doc: _Document, problem: str) -> str:
    """A 'daemon.KEY: text' (or 'daemon.etcd.KEY: text') problem, placed at KEY's line."""
    path, text = problem.split(": ", 1)
    return doc.problem(tuple(path.split(".")), text)


def _load_native(doc: _Document, role: str | None) -> KvxferdConfig:
    data = {k: v for k, v in doc.data.items() if not (k in SECTIONS and v is None)}
    engine = data.get("engine")
    if isinstance(engine, dict) and "kv_layout" in engine and engine["kv_layout"] is None:
        data["engine"] = {k: v for k, v in engine.items() if k != "kv_layout"}
    problems = _duplicate_problems(doc)
    cfg: KvxferdConfig | None = None
    try:
        cfg = KvxferdConfig.model_validate(data)
    except ValidationError as exc:
        problems += format_validation_error(
            exc, root=KvxferdConfig, source=doc.source, line_of=doc.line_of
        )
    if problems or cfg is None:
        raise _fail(doc.source, problems)
    if role is not None:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"role": role})})
    return _finish(cfg, doc, {})


def _load_role(doc: _Document, role: str) -> tuple[KvxferdConfig | None, list[str]]:
    """One role of a TensorRT-LLM file, or the problems that stop it."""
    mapping = trtllm.map_role(doc.data, role)
    sec_key = trtllm.SERVER_KEYS[role]
    read = (sec_key, *trtllm.ENGINE_KEYS, "cache_transceiver_config", "kv_cache_config")
    relevant: tuple[Loc, ...] = (
        *((k,) for k in read[1:]),
        *((sec_key, k) for k in read[1:]),
        ("schedule_style",),
    )
    problems = _duplicate_problems(doc, relevant)
    problems += [doc.problem(loc, message) for loc, message in mapping.problems]
    try:
        cfg = KvxferdConfig.model_validate(mapping.native)
    except ValidationError as exc:
        problems += format_validation_error(
            exc,
            root=KvxferdConfig,
            source=doc.source,
            to_file=mapping.to_file,
            line_of=doc.line_of,
        )
        return None, problems
    if problems:
        return None, problems
    paths = {".".join(map(str, k)): dotted(v) for k, v in mapping.prefixes.items()}
    return _finish(cfg, doc, paths), []


def _load_doc(doc: _Document, role: str | None) -> KvxferdConfig:
    _check_role(role, doc.source)
    if not trtllm.is_disagg_file(doc.data):
        return _load_native(doc, role)
    if role is None or role == "both":
        raise _fail(
            doc.source,
            [
                f"{doc.source}: this is a TensorRT-LLM disaggregated-serving file "
                f"({', '.join(trtllm.SERVER_KEYS[r] for r in trtllm.roles_present(doc.data))}); "
                "pass --role context or --role generation to choose the section kvxferd reads "
                "(`kvxferd config validate` without --role checks both)"
            ],
        )
    cfg, problems = _load_role(doc, role)
    if cfg is None:
        raise _fail(doc.source, problems)
    return cfg


def _read(path: str | os.PathLike[str]) -> tuple[str, str]:
    source = os.fspath(path)
    try:
        return Path(source).read_text(encoding="utf-8"), source
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _fail(source, [f"{source}: cannot read the configuration file: {reason}"]) from None


def load_config_text(
    text: str, source: str, role: str | None = None, *, base_dir: str | None = None
) -> KvxferdConfig:
    """Parse and validate configuration text; `source` names it in every message.

    `role` chooses the section of a TensorRT-LLM disaggregated file and overrides
    `engine.role` of a kvxferd file. A relative `daemon.shared_secret_file` is taken
    relative to `base_dir` (default: the current directory).
    """
    doc = _parse(text, source, Path(base_dir) if base_dir is not None else Path.cwd())
    return _load_doc(doc, role)


def load_config(path: str | os.PathLike[str], role: str | None = None) -> KvxferdConfig:
    """Read, parse and validate the configuration file at `path`.

    Raises ConfigError with one problem per issue, each naming the file and the YAML
    path of the offending value.
    """
    text, source = _read(path)
    return load_config_text(text, source, role, base_dir=str(Path(source).parent))


def is_disagg_text(text: str, source: str) -> bool:
    """Whether `text` is a TensorRT-LLM disaggregated-serving file (syntax errors raise)."""
    return trtllm.is_disagg_file(_parse(text, source, Path.cwd()).data)


def load_disagg_roles(
    path: str | os.PathLike[str], roles: tuple[str, ...] | None = None
) -> dict[str, KvxferdConfig]:
    """Each role present in a TensorRT-LLM disaggregated file (or those in `roles`).

    The problems of every role are reported together.
    """
    text, source = _read(path)
    doc = _parse(text, source, Path(source).parent)
    if not trtllm.is_disagg_file(doc.data):
        raise _fail(
            source,
            [
                f"{source}: not a TensorRT-LLM disaggregated-serving file "
                "(no context_servers: or generation_servers: at top level)"
            ],
        )
    configs: dict[str, KvxferdConfig] = {}
    problems: list[str] = []
    for role in roles or tuple(trtllm.roles_present(doc.data)):
        cfg, role_problems = _load_role(doc, role)
        problems += [p for p in role_problems if p not in problems]
        if cfg is not None:
            configs[role] = cfg
    if problems:
        raise _fail(source, problems)
    return configs


def load_disagg_pair(path: str | os.PathLike[str]) -> tuple[KvxferdConfig, KvxferdConfig]:
    """The (context, generation) configurations of a TensorRT-LLM disaggregated file."""
    configs = load_disagg_roles(path, ("context", "generation"))
    return configs["context"], configs["generation"]
