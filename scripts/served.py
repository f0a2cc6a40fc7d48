"""Start ``mlxb serve`` for a script and wait until ``/health`` answers (shared by the served scripts here)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx


def start(port: int, args: list, wait_s: int = 300) -> tuple[subprocess.Popen, str]:
    """``mlxb serve --port PORT ARGS`` in a child process; returns it and its base URL once healthy (or the wait ran out)."""
    proc = subprocess.Popen([sys.executable, "-m", "mlxb.commands.main", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(wait_s):
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return proc, base


def stop(proc: subprocess.Popen) -> str:
    """Terminate the server (kill it after 20 s) and return what it printed."""
    proc.terminate()
    try:
        return proc.communicate(timeout=20)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]
