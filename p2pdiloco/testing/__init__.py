"""Test networks and references for the tests and benchmarks; no command or node imports this.

``memnet``: whole nodes (real runtimes, syncers, learners) in one process over the in-memory
transport and plane. ``outer``: the whole-tensor outer optimizer that the windowed merge is
checked against.
"""
