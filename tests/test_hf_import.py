"""Two threads building their first model at once (found by bench/chaos.py: a restarted node's
learner on the main thread, its evaluator in a loop worker) must both get one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Thread B starts building at the moment thread A is inside the process's first
# `import transformers` (a finder on sys.meta_path sees transformers' submodules load).
RACE = textwrap.dedent(
    """
    import sys, threading
    import torch
    from p2pdiloco.train.models import build_model

    assert "transformers" not in sys.modules
    inside = threading.Event()

    class Spy:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("transformers.") and threading.current_thread().name == "A":
                inside.set()
            return None

    sys.meta_path.insert(0, Spy())
    errors = []

    def build():
        try:
            build_model("gemma-tiny", seed=0)
        except Exception as e:
            errors.append(repr(e))

    def second():
        inside.wait(60)
        build()

    threads = [threading.Thread(target=build, name="A"), threading.Thread(target=second, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(errors)
    sys.exit(1 if errors else 0)
    """
)


def test_two_threads_import_transformers_at_once() -> None:
    out = subprocess.run(
        [sys.executable, "-c", RACE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
