"""`kvxferd bench`: the transfer benchmark.

Each configuration moves KV through real daemons and bench engines in separate processes
(every byte verified); in the same run the same bytes with the same segments are moved by a
bare NIXL agent pair (`raw`), and one memcpy of a request's size gives the ceiling.

Modules:
  configs   the registry of configurations (name -> transceiver overrides + availability)
  plan      what every process of a run agrees on: geometry, block lists, request sequence
  engine    the bench engine process (`python -m kvxferd.bench.engine`), on kvxferd.client
  raw       the bare NIXL pair (`python -m kvxferd.bench.raw`), no daemon
  baseline  the memcpy ceiling
  stats     percentiles, busy-time bandwidth, joining both engines' records
  runner    the sweep and --small modes, and the report they make
  phases    one measurement's processes (daemons, engines, raw pair), started and joined
  host      the report's host facts, and the check that the pools fit
  report    table, JSON and plot
  progress  the stderr progress bar
"""
