"""The README's main command as a real process: starts, serves, and exits 0 on SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_mlxb_serve_process_serves_and_drains_on_sigterm():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxb.commands.main", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < 60, "server did not come up"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        out = proc.stdout.read()
        assert "mlxb serve" in out and "tiny-llama" in out and "mode=batch" in out
    finally:
        if proc.poll() is None:
            proc.kill()
