"""Hostile input for kvxferd's two wire protocols, and a bounded live fuzzer (issue 14).

Two halves, shared by the tests and the acceptance benchmark:

* generators (pure, seeded by a `random.Random`): frame bodies an attacker would send to
  the peer channel or the engine API. Well-typed messages with hostile values are built
  from the msgspec schemas themselves (`msgspec.inspect`; `values`), so a message type
  added to either union is fuzzed without touching this package. Garbage, mutated valid
  frames, wrong field types, deep nesting and lying length headers are built at the
  msgpack level (`bodies`).
* a live fuzzer: sends those to a real daemon, before (`preauth`) and after (`postauth`,
  `stolen`, over the `intruder`'s authenticated channel) a real handshake and over the
  engine socket (`engine`), and records what happened to every connection (`report`):
  answered, closed, or hung (neither within a deadline). `run` is the whole acceptance
  run.

Nothing here decodes with pickle; all decoding goes through kvxferd's own codecs.
"""

from kvxferd.sim.hostile.bodies import Bodies, frame
from kvxferd.sim.hostile.engine import fuzz_engine
from kvxferd.sim.hostile.intruder import Credentials
from kvxferd.sim.hostile.postauth import fuzz_postauth
from kvxferd.sim.hostile.preauth import fuzz_preauth
from kvxferd.sim.hostile.report import FuzzReport, LiveResult, crash_lines
from kvxferd.sim.hostile.run import run_live, verified_transfer
from kvxferd.sim.hostile.values import Values, message_types

__all__ = [
    "Bodies",
    "Credentials",
    "FuzzReport",
    "LiveResult",
    "Values",
    "crash_lines",
    "frame",
    "fuzz_engine",
    "fuzz_postauth",
    "fuzz_preauth",
    "message_types",
    "run_live",
    "verified_transfer",
]
