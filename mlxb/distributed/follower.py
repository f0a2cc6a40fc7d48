"""The follower side of ``--tp`` (ranks other than 0): replay rank 0's runner calls on this shard.

Rank 0's ``mlxb.distributed.leader.TPRunner`` sends each call as int32 words (see that module for the
protocol); ``follow`` decodes them in order and runs the same ``Runner`` methods, so every rank's KV
shard goes through the same joins, filters and steps. The follower samples nothing of its own:
tokens reach it inside each step's graph (``Link.share``).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from mlxb.engine.runner import FAULTS, Runner
from mlxb.distributed.link import Link
from mlxb.distributed.protocol import (CHUNK, COHORT, COMPACT, DECODE, DISK_DROP, DROP, ENGINE, EXTRACT, FILTER, FIRST,
                                       FORGET, FREE, JOIN, JOIN_COHORT, JOIN_MODES, NEW, PING, PUT, RESTORE, SEED,
                                       SETTLE, SPILL, STOP, VERIFY)
from mlxb.spec.verify import follow_verify, settle, settle_holes
from mlxb.distributed.cache import FollowerDisk, FollowerStore, rank_dir
from mlxb.request import Request


def _plan_from(words: list[int], n: int):
    from mlxb.cache.kv_plan import KVPlan, KVScheme

    if words[0] == -1:
        return None, 1
    start = words[0]
    layers = [KVScheme(words[1 + 2 * i], words[2 + 2 * i], start) if words[1 + 2 * i] else None for i in range(n)]
    return KVPlan(layers, start), 1 + 2 * n


def run_follower(model, link: Link, reload: Optional[Callable] = None, disk_dir: Optional[str] = None) -> int:
    """A rank other than 0: replay rank 0's runner calls on this shard until it says STOP. ``reload(recipes)``
    (parity) gives a fresh shard with those random-weight LoRA adapters installed (None: none);
    ``disk_dir``: the prompt cache's SSD folder (this rank's shards go to its ``tp<N>-rank<r>``)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 stops them (STOP)
    return follow(model, link, reload, disk_dir)


def _engine(model, w: list[int], i: int, reload: Optional[Callable], have: Optional[list], link: Link):
    """ENGINE: the runner rank 0 just built (on a fresh shard first when the LoRA recipes changed), its
    shared-prefix probe, then the KV projection forward its Engine runs next. Returns (runner, model, recipes,
    next index)."""
    from mlxb.cache.protocol import kv_projection, layer_kinds

    join_full, mask, n = JOIN_MODES[w[i + 1]], w[i + 2], w[i + 3]
    r = i + 4
    want = [{"seed": w[r + 3 * k], "rank": w[r + 3 * k + 1], "num_layers": w[r + 3 * k + 2]} for k in range(n)] or None
    if want != have:  # another case's adapters (or none): a fresh shard, as rank 0 loaded
        if reload is None:
            raise RuntimeError(f"rank 0 asks for LoRA recipes {want}; this follower cannot reload its model")
        model = reload(want)
    kinds = layer_kinds(model)
    plan, used = _plan_from(w[r + 3 * n :], len(kinds))
    runner = Runner(model, kinds, join_full=join_full, faults=frozenset(f for k, f in enumerate(FAULTS) if mask >> k & 1),
                    kv_scheme=plan)
    share_min = w[r + 3 * n + used]
    runner.setup_sharing(None if share_min < 0 else share_min, lambda ok: link.agree(ok) == link.size)
    if all(k is not None for k in kinds):
        kv_projection(model, kinds, runner.kv)
    return runner, model, want, r + 3 * n + used + 1


def follow(model, link: Link, reload: Optional[Callable] = None, disk_dir: Optional[str] = None) -> int:
    """The follower's loop: one message at a time, its ops in order."""
    disk = FollowerDisk(rank_dir(disk_dir, link.size, link.rank)) if disk_dir else None
    runner: Optional[Runner] = None
    recipes = None  # the LoRA recipes the current shard carries (parity)
    rows: dict[int, object] = {}
    cohort = store = None
    while True:
        w = link.recv()
        i = 0
        while i < len(w):
            op = w[i]
            if op == ENGINE:
                runner, model, recipes, i = _engine(model, w, i, reload, recipes, link)
                runner.share = link.share
                rows, cohort, store = {}, None, FollowerStore(runner.kinds, disk)
            elif op == NEW:  # key, LoRA adapter slot, prompt length, prompt ids
                key, slot, n = w[i + 1], w[i + 2], w[i + 3]
                rows[key] = runner.new_row(Request(f"tp-{key}", w[i + 4 : i + 4 + n], max_tokens=1 << 30, adapter=slot))
                i += 4 + n
            elif op == CHUNK:
                runner.prefill_chunk(rows[w[i + 1]], w[i + 2], w[i + 3], bool(w[i + 4]))
                i += 5
            elif op == FIRST:
                runner.first_token(rows[w[i + 1]])
                i += 2
            elif op == COHORT:  # keys, starts, whether rank 0 snapshots the cohort's rows (the prompt cache)
                n = w[i + 1]
                store.cohort = {}
                snap = store.cohort.__setitem__ if w[i + 2 + 2 * n] else None
                cohort = runner.prefill_cohort([rows[k] for k in w[i + 2 : i + 2 + n]], w[i + 2 + n : i + 2 + 2 * n],
                                               snap)[0]
                i += 3 + 2 * n
            elif op == SEED:  # row key, entry id, tokens
                rows[w[i + 1]].solo = store.lend(w[i + 2], w[i + 3])
                i += 4
            elif op == PUT:  # entry id, source kind, source index, tokens
                store.put(w[i + 1], w[i + 2], w[i + 3], w[i + 4], rows)
                i += 5
            elif op == FREE:
                store.entries.pop(w[i + 1], None)
                i += 2
            elif op == SPILL:  # entry id, its name on disk (6 words)
                store.spill(w[i + 1], w[i + 2 : i + 8])
                i += 8
            elif op == RESTORE:  # entry id, name; then every rank says whether its shard was whole
                store.restore(w[i + 1], w[i + 2 : i + 8], link)
                i += 8
            elif op == DISK_DROP:
                store.drop(w[i + 1 : i + 7])
                i += 7
            elif op == EXTRACT:
                n = w[i + 1]
                store.extracted = [layers for _, layers, _ in runner.extract_rows(w[i + 2 : i + 2 + n])]
                i += 2 + n
            elif op == JOIN_COHORT:
                n = w[i + 1]
                keys, tokens = w[i + 2 : i + 2 + n], w[i + 2 + n : i + 2 + 2 * n]
                m = w[i + 2 + 2 * n]
                keep = w[i + 3 + 2 * n : i + 3 + 2 * n + m]
                runner.join_cohort(cohort, [rows[k] for k in keys], tokens, keep)
                cohort = None
                i += 3 + 2 * n + m
            elif op == JOIN:
                runner.join(rows[w[i + 1]], w[i + 2])
                i += 3
            elif op == DECODE:
                runner.decode_step()
                i += 1
            elif op == VERIFY:  # rows, each row's draft count, the drafts
                n = w[i + 1]
                lens, at, props = w[i + 2 : i + 2 + n], i + 2 + n, []
                for k in lens:
                    props.append(w[at : at + k])
                    at += k
                follow_verify(runner, props)
                i = at
            elif op == SETTLE:  # rows, width, kept per row, last token per row
                n, width = w[i + 1], w[i + 2]
                settle(runner, w[i + 3 : i + 3 + n], w[i + 3 + n : i + 3 + 2 * n], width)
                i += 3 + 2 * n
            elif op == COMPACT:
                settle_holes(runner)
                i += 1
            elif op == FILTER:
                n = w[i + 1]
                runner.filter(w[i + 2 : i + 2 + n])
                i += 2 + n
            elif op == DROP:
                runner.drop_all()
                i += 1
            elif op == FORGET:
                n = w[i + 1]
                for k in w[i + 2 : i + 2 + n]:
                    rows.pop(k, None)
                i += 2 + n
            elif op == PING:
                i += 1
            elif op == STOP:
                if runner is not None:
                    runner.drop_all()
                mx.synchronize()
                if disk is not None:  # the RAM tier rank 0 spilled before STOP is written before we exit
                    disk.close()
                return 0
            else:
                raise RuntimeError(f"rank {link.rank}: unknown tensor-parallel op {op} (ranks out of step)")
