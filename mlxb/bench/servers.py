"""Start and stop the stacks a benchmark compares: ``mlxb serve`` and ``mlx_lm.server``.

Both serve the same model folder on 127.0.0.1. A stack is ready when ``/v1/models`` answers (and,
for mlxb, ``/health`` is 200). Stopping sends SIGTERM, then SIGKILL after a grace period; each
server's output goes to a log file so a failure can be read afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import httpx

STACKS = ("mlxb", "mlx-lm", "mlxb-spec-off", "mlxb-share-off", "mlxb-prep-inline", "mlxb-fused-off",
          "mlxb-gil-0.5ms")  # mlxb with one feature off (on against off)
OFF_FLAGS = {"mlxb-spec-off": ["--spec", "off"], "mlxb-share-off": ["--no-share-prefix"],
             "mlxb-prep-inline": ["--prep-threads", "0"], "mlxb-fused-off": ["--kv-attention", "mlx-lm"],
             "mlxb-gil-0.5ms": ["--switch-interval-ms", "0.5"]}  # the GIL handed over every 0.5 ms, not Python's 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    stack: str
    model_path: str
    port: int
    proc: subprocess.Popen
    log_path: str
    flags: list[str]
    owned_dir: Optional[str] = None  # the private SSD tier made for this start: removed when it stops

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model_name(self) -> str:
        return self.model_path  # both stacks accept the folder path as the model id

    def log_tail(self, n: int = 30) -> str:
        try:
            return "".join(open(self.log_path, errors="replace").readlines()[-n:])
        except OSError:
            return ""

    def stats(self, timeout: float = 10.0) -> Optional[dict]:
        """An mlxb server's ``/stats`` (batching, prompt cache, shared prefix, speculation), or None (the peer has
        none, or it did not answer)."""
        if not self.stack.startswith("mlxb") or self.proc.poll() is not None:
            return None
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}/stats", timeout=timeout)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def stop(self, grace: float = 10.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # mlx_lm.server ignores a plain SIGTERM while serving
                self.proc.wait(5)
        if self.owned_dir is not None:  # an 8B model's tier holds tens of GB: a benchmark leaves none behind
            shutil.rmtree(self.owned_dir, ignore_errors=True)
            self.owned_dir = None
        return self.proc.returncode


def command(stack: str, model_path: str, port: int, batch: int, prefill_step: int, max_tokens: int,
            prompt_cache_dir: Optional[str] = None, extra: tuple = ()) -> list[str]:
    return _base_command(stack, model_path, port, batch, prefill_step, max_tokens, prompt_cache_dir) + list(extra)


def _base_command(stack: str, model_path: str, port: int, batch: int, prefill_step: int, max_tokens: int,
                  prompt_cache_dir: Optional[str]) -> list[str]:
    if stack == "mlxb" or stack in OFF_FLAGS:
        # NOTE: a private SSD tier per start unless one is given: a benchmark never hits an earlier run's files
        return [sys.executable, "-m", "mlxb.commands.main", "serve", "--model", model_path, "--port", str(port),
                "--batch", str(batch), "--prefill-step-size", str(prefill_step), "--max-tokens", str(max_tokens),
                "--log-level", "warning", "--prompt-cache-dir",
                prompt_cache_dir or tempfile.mkdtemp(prefix="mlxb-bench-prompt-cache-")] + OFF_FLAGS.get(stack, [])
    if stack == "mlx-lm":
        return [sys.executable, "-m", "mlx_lm.server", "--model", model_path, "--port", str(port),
                "--decode-concurrency", str(batch), "--prefill-step-size", str(prefill_step),
                "--max-tokens", str(max_tokens), "--log-level", "WARNING"]
    raise ValueError(f"unknown stack {stack!r}; stacks: {', '.join(STACKS)}")


def start(stack: str, model_path: str, *, batch: int = 8, prefill_step: int = 2048, max_tokens: int = 512,
          ready_timeout: float = 300.0, prompt_cache_dir: Optional[str] = None, extra: tuple = ()) -> Server:
    port = free_port()
    owned = None
    if prompt_cache_dir is None and (stack == "mlxb" or stack in OFF_FLAGS):
        prompt_cache_dir = owned = tempfile.mkdtemp(prefix="mlxb-bench-prompt-cache-")
    cmd = command(stack, model_path, port, batch, prefill_step, max_tokens, prompt_cache_dir, extra)
    log = tempfile.NamedTemporaryFile("w", prefix=f"mlxb-bench-{stack}-", suffix=".log", delete=False)
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(stack, model_path, port, proc, log.name, cmd[3:], owned)
    deadline = time.monotonic() + ready_timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{stack} server exited with {proc.returncode} before it was ready:\n{srv.log_tail()}")
            try:
                r = httpx.get(srv.base_url + "/models", timeout=2)
                if r.status_code == 200:
                    return srv
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{stack} server not ready after {ready_timeout:.0f}s:\n{srv.log_tail()}")
    except BaseException:  # not ready, or the caller interrupted (Ctrl-C, SIGTERM) while it loaded: no orphan
        srv.stop()
        raise
