"""Whole runs driven from one place, offered to users and used by the tests and benchmarks: the
in-process ``simulate``, the local-network ``demo`` with its summary, and the Sybil flood."""
