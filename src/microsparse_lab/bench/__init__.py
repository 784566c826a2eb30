"""Benchmarks run by ``microsparse bench``: one module per benchmark."""
