"""The engine thread's end, made safe for the process's exit.

MLX keeps some state per thread (its compile cache, which holds Python functions, filled by mlx-lm's
own compiled helpers and by ``--compile-decode``). It is destroyed when the OS thread ends, which is
after ``Thread.join`` returns; if the interpreter is finalizing by then, that destructor aborts the
process ("terminate called without an active exception", exit 134). So the engine thread drops its
compiled graphs itself, ``Engine.stop`` waits until the thread has really gone, and engines nobody shut
down are stopped by an ``atexit`` hook while the interpreter is still whole.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref


def release_thread_state(runner) -> None:
    """On the engine thread, before it ends: drop its compiled decode graphs (``--compile-decode``)."""
    compiled = getattr(runner, "compiled", None)
    if compiled is not None:
        compiled.release()


def wait_gone(thread: threading.Thread, limit: float = 2.0) -> None:
    """Wait until a joined thread's OS thread has ended (Linux shows it in /proc; elsewhere a short pause)."""
    if not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return
    path = f"/proc/self/task/{thread.native_id}"
    t0 = time.monotonic()
    while os.path.exists(path) and time.monotonic() - t0 < limit:
        time.sleep(0.002)


def stop_at_exit(engine) -> None:
    """Stop ``engine`` at interpreter exit if it is still running (held weakly)."""
    atexit.register(_stop, weakref.ref(engine))


def _stop(ref) -> None:
    eng = ref()
    if eng is not None and eng._thread.is_alive():
        eng.stop(timeout=10.0)
