"""The worker process's heap once started (``sluice.worker.main._settle_heap``): start-up's garbage is
collected, and what survives goes to the collector's permanent generation. Run in a child process: freezing
the test process's own heap would keep pytest's garbage forever."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import gc, weakref
from sluice.worker.main import _settle_heap

class Node:
    pass

a, b = Node(), Node()
a.peer, b.peer = b, a  # a cycle only the collector frees
dead = weakref.ref(a)
kept = Node()
alive = weakref.ref(kept)
del a, b
assert gc.get_freeze_count() == 0
_settle_heap()
assert dead() is None, "start-up's garbage cycle was frozen instead of collected"
assert alive() is kept
print(gc.get_freeze_count(), gc.get_count()[0])
"""


def test_start_up_garbage_is_collected_and_the_rest_frozen() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    frozen, young = (int(x) for x in out.stdout.split())
    assert frozen > 10_000  # the imported modules' functions, types and dicts at least
    assert young < 100  # nothing left waiting for a collection
