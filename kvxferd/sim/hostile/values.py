"""Schema-driven hostile values: well-typed values a msgspec schema accepts but a daemon
should not trust, and whole messages of any type of a union built from them (issue 14)."""

from __future__ import annotations

import random
import typing
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvxferd.memory.layout import KvLayout
from kvxferd.sim.cluster import DEFAULT_GEOMETRY

# A line a hostile string tries to forge in a daemon log (after a newline it carries).
FORGED_LINE = "2026-12-01 00:00:00,000 ERROR kvxferd.forged hostile line"


def message_types(union: object) -> list[type[msgspec.Struct]]:
    """The Struct classes of a message union (PeerMessage, EngineMessage...)."""
    return [t for t in typing.get_args(union) if isinstance(t, type)]


def tag_of(cls: type[msgspec.Struct]) -> str:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType) and isinstance(info.tag, str)
    return info.tag


def fields_of(cls: type[msgspec.Struct]) -> tuple[mi.Field, ...]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


INTS = (0, 1, -1, 2, 7, 255, 256, 65535, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1,
         2**63 - 1, -(2**63), 2**64 - 1)  # fmt: skip
STRINGS = (
    "",
    " ",
    "a",
    "pool0",
    "r-0",
    "../../etc/passwd",
    "/dev/shm/x",
    "127.0.0.1:1",
    "%s%n%x",
    "\x00",
    "\x1b[31mred",
    "é\u202e\ufeff",
    "\U0001f4a9" * 3,
    f"x\n{FORGED_LINE}",
    f"x\r\n{FORGED_LINE}",
)


class Values:
    """Well-typed values that a schema accepts but a daemon should not trust: extreme
    integers, empty and oversized strings, control characters and newlines (log forging),
    long lists, nested free-form maps. `max_str` and `max_list` bound the sizes."""

    def __init__(self, rng: random.Random, max_str: int = 4096, max_list: int = 2048) -> None:
        self.rng = rng
        self.max_str = max_str
        self.max_list = max_list

    def int_(self) -> int:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.choice(INTS)
        if r < 0.8:
            return self.rng.randint(-4, 300)
        return self.rng.randint(-(2**63), 2**64 - 1)

    def str_(self) -> str:
        r = self.rng.random()
        if r < 0.55:
            return self.rng.choice(STRINGS)
        if r < 0.8:
            n = self.rng.randint(1, 64)
            return "".join(chr(self.rng.choice((self.rng.randint(0, 0x7F), 0x2028, 0xE9)))
                           for _ in range(n))  # fmt: skip
        return self.rng.choice("aZ\n") * self.rng.randint(64, self.max_str)

    def bytes_(self) -> bytes:
        r = self.rng.random()
        if r < 0.3:
            return b""
        if r < 0.8:
            return self.rng.randbytes(self.rng.choice((1, 16, 31, 32, 33, 64)))
        return self.rng.randbytes(self.rng.randint(64, self.max_str))

    def float_(self) -> float:
        return self.rng.choice((0.0, -0.0, 1e308, -1e308, float("inf"), float("nan"), 1.5))

    def free(self, depth: int = 0) -> object:
        """Any msgpack value (a field typed `object`)."""
        kinds = ["int", "str", "nil", "bool", "float", "bytes"]
        if depth < 4:
            kinds += ["list", "map", "map"]
        kind = self.rng.choice(kinds)
        if kind == "list":
            return [self.free(depth + 1) for _ in range(self.rng.randint(0, 6))]
        if kind == "map":
            return {self.str_()[:32]: self.free(depth + 1) for _ in range(self.rng.randint(0, 6))}
        return {
            "int": self.int_,
            "str": self.str_,
            "nil": lambda: None,
            "bool": lambda: self.rng.random() < 0.5,
            "float": self.float_,
            "bytes": self.bytes_,
        }[kind]()

    def length(self) -> int:
        r = self.rng.random()
        if r < 0.7:
            return self.rng.randint(0, 8)
        if r < 0.95:
            return self.rng.randint(9, 256)
        return self.rng.randint(257, self.max_list)

    def of(self, t: mi.Type, depth: int = 0) -> object:
        """A value of schema type `t` (msgspec.inspect)."""
        if isinstance(t, mi.IntType):
            return self.int_()
        if isinstance(t, mi.StrType):
            return self.str_()
        if isinstance(t, mi.BytesType):
            return self.bytes_()
        if isinstance(t, mi.BoolType):
            return self.rng.random() < 0.5
        if isinstance(t, mi.FloatType):
            return self.float_()
        if isinstance(t, mi.NoneType):
            return None
        if isinstance(t, mi.UnionType):
            return self.of(self.rng.choice(t.types), depth)
        if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
            # Long lists only at the top: nested ones multiply (a list of pools of lists).
            n = self.length() if depth == 0 else self.rng.randint(0, 3)
            items = [self.of(t.item_type, depth + 1) for _ in range(n)]
            if isinstance(t, mi.VarTupleType):
                return tuple(items)
            return items if isinstance(t, mi.ListType) else set(map(_hashable, items))
        if isinstance(t, mi.DictType):
            n = self.rng.randint(0, 8)
            return {_hashable(self.of(t.key_type, depth + 1)): self.of(t.value_type, depth + 1)
                    for _ in range(n)}  # fmt: skip
        if isinstance(t, mi.StructType):
            return self.message(t.cls, depth + 1)
        if isinstance(t, (mi.AnyType, mi.CustomType)):
            return self.free(depth)
        raise TypeError(f"no hostile values for schema type {t!r}; teach kvxferd.sim.hostile")

    def message(self, cls: type[msgspec.Struct], depth: int = 0) -> msgspec.Struct:
        """A `cls` with every field (optional ones too, mostly) set to a hostile value."""
        kwargs = {
            f.name: self.of(f.type, depth)
            for f in fields_of(cls)
            if f.required or self.rng.random() < 0.8
        }
        return cls(**kwargs)


def _hashable(value: object) -> Any:
    return value if isinstance(value, (str, int, float, bool, bytes, type(None))) else repr(value)


def hostile_layout(rng: random.Random, values: Values) -> dict[str, object]:
    layout = dict(DEFAULT_GEOMETRY)
    layout.update(major="block-major", kv_factor=2, num_blocks=16)
    for key in rng.sample(sorted(layout), rng.randint(0, 3)):
        layout[key] = values.free()
    if rng.random() < 0.2:
        layout[values.str_()[:16]] = values.free()
    return layout


def fuzz_layout(num_blocks: int = 16) -> KvLayout:
    g = DEFAULT_GEOMETRY
    return KvLayout(
        num_layers=g["num_layers"], kv_factor=2, num_kv_heads=g["num_kv_heads"],
        head_dim=g["head_dim"], tokens_per_block=g["tokens_per_block"], dtype=g["dtype"],
        major="block-major", num_blocks=num_blocks,
    )  # fmt: skip
