"""transformers' process-wide state, touched by one thread at a time.

Two parts of transformers are not thread-safe, and a node builds models on several threads (the
learner's on the main thread, the evaluator's and the committee's held-out model in loop
workers):

- **The package import.** A thread that runs ``from transformers import X`` while another thread
  is still inside the first ``import transformers`` of the process fails with ``ImportError:
  cannot import name 'X' from 'transformers'`` (transformers 5.24, CPython 3.11). A restarted
  node hit it (bench/chaos.py). Every ``from transformers import ...`` in p2pdiloco calls
  :func:`import_transformers` first.
- **Model construction.** ``no_init_weights`` (used by ``build_for_loading`` and by every
  ``from_pretrained``) swaps ``torch.nn.init``'s functions for no-ops and puts back what it found
  on exit. Two threads inside it at once interleave as: A saves the real functions, B saves A's
  no-ops, A restores the real ones, B restores the no-ops, and from then on every model the
  process builds keeps ``torch.empty`` garbage as its "seeded" init (CI, stop 46: one pytest
  worker's every later model trained to ``loss is nan`` at step 0). The seeded build also
  reseeds the global RNG under ``fork_rng``. Every construction of a transformers model in
  p2pdiloco runs inside :func:`building_models`.

One re-entrant lock covers both, so a build may import.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType

_LOCK = threading.RLock()


def import_transformers() -> ModuleType:
    """``transformers``, imported by one thread at a time (the first call pays the import)."""
    with _LOCK:
        import transformers

    return transformers


@contextlib.contextmanager
def building_models() -> Iterator[None]:
    """Hold transformers' process-wide state (init functions, the global RNG of a seeded
    build) for one model construction or load; other threads' builds wait."""
    with _LOCK:
        yield
