"""Benchmarks: quicsrv against the raw engine and llama-cpp-python's server, and the probes."""
