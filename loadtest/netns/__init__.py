"""Benchmarks over emulated networks (network namespaces, netem)."""
