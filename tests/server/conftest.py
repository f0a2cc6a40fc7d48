import socket
import threading
import time

import httpx
import pytest
import uvicorn

from mlxb.engine.build import build_gateway
from mlxb.server.app import create_app


class LiveServer:
    def __init__(self, **kw):
        api_key = kw.pop("api_key", None)
        self.gw = build_gateway(kw.pop("model", "tiny-llama"), **kw)
        self.app = create_app(self.gw, api_key=api_key, max_body_bytes=64 * 1024)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(100):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(5)
        self.gw.engine.shutdown()


@pytest.fixture(scope="module")
def live():
    srv = LiveServer(batch=8, default_max_tokens=16)
    yield srv
    srv.stop()


@pytest.fixture
def client(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c
