"""The one import of transformers per process, under a lock.

transformers' package import is not thread-safe: a thread that runs ``from transformers import X``
while another thread is still inside the first ``import transformers`` of the process fails with
``ImportError: cannot import name 'X' from 'transformers'`` (transformers 5.24, CPython 3.11). A
restarted node hit it (bench/chaos.py): it resumes from its saved state, so the first model it
builds is the learner's, on the main thread, while the evaluator builds one in a loop worker for
the version the node just caught up to. Once the package is imported, its lazy attributes load
safely from any thread, so every ``from transformers import ...`` in p2pdiloco calls
:func:`import_transformers` first.
"""

from __future__ import annotations

import threading
from types import ModuleType

_LOCK = threading.Lock()


def import_transformers() -> ModuleType:
    """``transformers``, imported by one thread at a time (the first call pays the import)."""
    with _LOCK:
        import transformers

    return transformers
