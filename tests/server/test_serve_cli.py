"""The README's main command as a real process: starts, serves, and exits 0 on SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_healthy(proc, port: int) -> str:
    """The server's base URL once /health answers 200 (the process must stay up meanwhile)."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < 60, "server did not come up"
        time.sleep(0.2)


def test_mlxb_serve_process_serves_and_drains_on_sigterm():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxb.commands.main", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        url = wait_healthy(proc, port)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        out = proc.stdout.read()
        assert "mlxb serve" in out and "tiny-llama" in out and "mode=batch" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_mlxb_serve_with_quantized_kv_and_a_bad_group_size(tmp_path):
    """--kv-bits from the command line: /stats names the scheme, a constrained request answers; a group
    size that does not divide the head dimension exits with a message naming the fix."""
    bad = subprocess.run([sys.executable, "-m", "mlxb.commands.main", "serve", "--kv-bits", "4", "--port", "1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "group size" in (bad.stdout + bad.stderr)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxb.commands.main", "serve", "--port", str(port), "--kv-bits", "4",
                             "--kv-group-size", "32", "--prompt-cache-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        url = wait_healthy(proc, port)
        stats = httpx.get(url + "/stats").json()["engine"]
        assert stats["kv_scheme"] == "kv4g32s0"
        # the default --kv-attention auto: CUDA's fused kernels are never taken on another backend
        import mlx.core as mx
        if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
            assert (stats["kv_attention"], stats["kv_attention_auto"]) == ("mlx-lm", "auto: not a CUDA device")
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                "structured_outputs": {"choice": ["alpha", "beta"]}}
        for _ in range(2):  # the second one is a prompt-cache hit on packed rows
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("alpha", "beta")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


CRASH_MARKS = ("Traceback", "terminate called", "Aborted", "Segmentation fault", "core dumped")


@pytest.mark.parametrize("sig,batch", [(signal.SIGINT, "4"), (signal.SIGTERM, "1")])
def test_a_busy_server_stops_cleanly_and_answers_its_open_streams(sig, batch):
    """SIGINT/SIGTERM while streams decode (batched and serial lanes): exit 0, nothing crashes at exit,
    every open stream ends with the shutting-down error and [DONE] instead of being cut."""
    import threading

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxb.commands.main", "serve", "--port", str(port), "--batch", batch],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    ends = []
    try:
        url = wait_healthy(proc, port)

        def stream():
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "ignore_eos": True,
                    "stream": True}
            lines = []
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines = [x for x in r.iter_lines() if x]
            ends.append(lines[-3:])  # the error event, the final chunk, [DONE]

        clients = [threading.Thread(target=stream) for _ in range(3)]
        for c in clients:
            c.start()
        t0 = time.monotonic()
        while httpx.get(url + "/stats").json()["engine"]["steps"] < 20:  # decoding is under way
            assert time.monotonic() - t0 < 60
            time.sleep(0.1)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        for c in clients:
            c.join(30)
        err = proc.stderr.read()
        assert not any(m in err for m in CRASH_MARKS), err[-3000:]
        assert len(ends) == 3
        for last in ends:
            assert last[-1] == "data: [DONE]" and "shutting down" in "".join(last), last
    finally:
        if proc.poll() is None:
            proc.kill()


def _catches(pid: int, sig) -> bool:
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        time.sleep(6)  # no /proc (macOS): give the process time to start
        return True
    caught = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), 16)
    return bool(caught >> (int(sig) - 1) & 1)


def _sigint_default() -> None:
    """A background job of a non-interactive shell (CI, nohup ... &) starts with SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler: give the command the disposition a terminal gives it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _to_other_threads(pid: int, sig) -> None:
    """Deliver ``sig`` to one thread other than the main one (tgkill), as Linux may do with a
    process-directed signal: Python's handler still has to run on the main thread."""
    import ctypes

    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert tids, "the command runs no worker threads"
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, tids[-1], int(sig)) == 0


FULL = pytest.mark.full  # one signal case runs in the default tier, the others in the full tier


@pytest.mark.parametrize("sig,code,target", [pytest.param(signal.SIGINT, 130, "process", marks=FULL),
                                             (signal.SIGTERM, 143, "process"),
                                             pytest.param(signal.SIGINT, 130, "worker", marks=FULL),
                                             pytest.param(signal.SIGTERM, 143, "worker", marks=FULL)])
@pytest.mark.parametrize("json_out", [True, pytest.param(False, marks=pytest.mark.full)])
def test_generate_interrupted_mid_batch_exits_with_the_signal_code_and_no_crash(sig, code, target, json_out):
    if target == "worker" and not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux /proc and tgkill")
    k = "8" if json_out else "1"  # --json: consumer threads joined by the main thread; k=1: the main thread reads the stream
    proc = subprocess.Popen([sys.executable, "-m", "mlxb.commands.main", "generate", "-p", "hi", "-k", k, "--batch",
                             "8", "-n", "4000"] + (["--json"] if json_out else []), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONFAULTHANDLER="1"),
                            preexec_fn=_sigint_default)
    t0 = time.monotonic()
    while not _catches(proc.pid, signal.SIGTERM):  # the command's handler is in place (Linux: /proc)
        assert proc.poll() is None and time.monotonic() - t0 < 120, proc.stderr.read()
        time.sleep(0.1)
    time.sleep(4)  # model loaded, rows decoding (8 rows of 4000 tokens take far longer)
    assert proc.poll() is None
    if target == "worker":
        _to_other_threads(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # a hang: SIGABRT makes faulthandler print every thread's stack
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"no exit 30 s after {sig!r}; threads at the hang:\n{err[-6000:]}")
    assert rc == code
    err = proc.stderr.read() + proc.stdout.read()
    assert "interrupted" in err and not any(m in err for m in CRASH_MARKS), err[-3000:]


def test_mlxb_serve_refuses_an_unknown_lora_path():
    bad = subprocess.run([sys.executable, "-m", "mlxb.commands.main", "serve", "--lora-path", "fast", "--port", "1"],
                         capture_output=True, text=True, timeout=120)
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "--lora-path" in out and "stacked" in out and "Traceback" not in out


def test_mlxb_serve_sets_the_gil_switch_interval():
    """--switch-interval-ms reaches the process (sys.setswitchinterval); the start-up line and /stats say so."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxb.commands.main", "serve", "--port", str(port), "--no-warmup",
                             "--switch-interval-ms", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        url = wait_healthy(proc, port)
        assert httpx.get(url + "/stats").json()["gil_switch_interval_ms"] == 0.5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "GIL switch interval: 0.5 ms" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
