"""A served workload that keeps making new CUDA graph topologies: start ``mlxb serve`` with the flags given, send
REQUESTS chat completions from 8 threads with random prompt lengths, output lengths and draft lengths (so batch
sizes, verify widths and prefill shapes keep changing), then print how many finished, failed, ``/health`` and
``/stats``' ``cuda_graph_check``. The environment passes through (``MLX_CUDA_GRAPH_CACHE_SIZE``,
``MLX_ENABLE_CACHE_THRASHING_CHECK``). Exits 1 if a request failed or ``/health`` is not ok.

    python3 scripts/graph_cache_stress.py PORT REQUESTS --model M [serve flags ...]
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import sys
import time

import httpx

import served  # scripts/served.py


def main() -> int:
    port, n, args = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    model = args[args.index("--model") + 1]
    proc, base = served.start(port, args)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    try:
        def one(i: int):
            rng = random.Random(i)
            body = {"model": model, "temperature": 0, "max_tokens": rng.randint(4, 64),
                    "num_draft_tokens": rng.choice([0, 2, 3, 4, 6, 8]),
                    "messages": [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(3, 600)))}]}
            try:
                r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
                return r.status_code, (r.json().get("error") or {}).get("message", "")[:160] if r.status_code != 200 else ""
            except httpx.HTTPError as e:
                return -1, str(e)[:160]

        t0 = time.time()
        with cf.ThreadPoolExecutor(8) as ex:
            res = list(ex.map(one, range(n)))
        ok = sum(1 for c, _ in res if c == 200)
        errors = sorted({m for c, m in res if c != 200})
        health = httpx.get(f"{base}/health")
        eng = httpx.get(f"{base}/stats").json().get("engine", {})
        sp = eng.get("speculation") or {}
        print(json.dumps({"requests": n, "ok": ok, "failed": n - ok, "errors": errors[:5], "seconds": round(time.time() - t0, 1),
                          "health": [health.status_code, health.json()], "cuda_graph_check": eng.get("cuda_graph_check"),
                          "verify_steps": sp.get("verify_steps"), "drafted": sp.get("drafted"), "accepted": sp.get("accepted")}))
        return 0 if ok == n and health.status_code == 200 else 1
    finally:
        out = served.stop(proc)
        tail = [ln for ln in out.splitlines() if "thrash" in ln.lower() or "Error" in ln][-5:]
        if tail:
            print("server log:", *tail, sep="\n  ")


if __name__ == "__main__":
    sys.exit(main())
