"""Hosts with their own network stacks, on one machine, for the cluster tests and demo.

- network: network namespaces joined by veth pairs to a bridge, each host one
  long-lived holder process (its own IPC, PID and mount namespaces, a private
  /dev/shm), and a launcher that runs a command inside a host.
- faults: partitions, link down, random packet loss (nftables), rate limits (tc tbf).
- cluster: daemons and reference engines placed on hosts (or on plain loopback).
- traffic: verified requests between every context and every generation instance,
  and the check that each reached exactly one outcome.
"""
