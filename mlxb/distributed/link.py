"""The ranks of ``--tp`` and how rank 0 talks to them (``mlxb.distributed.leader``): the world group, sharding a model
with its own ``shard(group)``, which ``mx.distributed`` backend ``mlx.launch`` set up, and ``Link``: int32
messages from rank 0 (a ``HEAD``-word head, then the rest) and the in-graph broadcast of sampled tokens."""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

from mlxb.errors import ValidationError
from mlxb.kernels.split_read import share_cores

HEAD = 32  # words in the first all_sum of a message (its length, then up to 31 words)


def init_group(tp: int):
    """The world group of ``tp`` processes started by ``mlx.launch``; a clear error otherwise."""
    group = mx.distributed.init()
    if group.size() != tp:
        raise ValidationError(
            f"--tp {tp} needs {tp} processes, found {group.size()}: start every rank with mlx.launch, e.g. "
            f"'mlx.launch --backend ring -n {tp} -- mlxb serve --tp {tp} ...' on one machine (CPU), "
            f"'--backend nccl' for {tp} CUDA GPUs, or '--hostfile hosts.json' for several Macs (see the README)",
            param="tp")
    share_cores(tp)  # CPU ranks are taken to share one host (mlx.launch -n N on it); GPUs do not split
    return group


def shard_model(model, group, name: str) -> None:
    """Shard ``model`` in place with its own ``shard(group)``; refuse what cannot be split evenly."""
    n = group.size()
    if not hasattr(model, "shard"):
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
        raise ValidationError(f"{name} ({kind}) has no tensor-parallel sharding in mlx-lm (no Model.shard); "
                              "--tp works for architectures that have one (llama, qwen2/3, qwen3.5, deepseek, ...)",
                              param="tp")
    for i, layer in enumerate(getattr(model, "layers", [])):
        attn = getattr(layer, "self_attn", None)
        for attr in ("n_heads", "n_kv_heads", "num_attention_heads", "num_key_value_heads"):
            v = getattr(attn, attr, None)
            if isinstance(v, int) and v % n:
                raise ValidationError(f"{name}: layer {i} has {v} {attr.replace('_', ' ')}, not divisible by --tp {n}; "
                                      f"choose a --tp that divides it", param="tp")
    try:
        model.shard(group)
    except (ValueError, AssertionError) as e:
        raise ValidationError(f"{name} cannot be sharded {n} ways: {e}", param="tp") from None
    mx.eval(model.parameters())


def backend_name() -> str:
    """Which ``mx.distributed`` backend ``mlx.launch`` set up, from the environment it exports."""
    env = os.environ
    if "NCCL_HOST_IP" in env:
        return "nccl"
    if "MLX_IBV_DEVICES" in env or "MLX_JACCL_COORDINATOR" in env:
        return "jaccl"
    if "MLX_MPI_LIBNAME" in env or "OMPI_COMM_WORLD_RANK" in env:
        return "mpi"
    return "ring" if "MLX_HOSTFILE" in env else "unknown"


def command_group(group):
    """A second group for rank 0's messages when the main one is NCCL, or None (messages use the main group).

    NCCL collectives run in the GPU stream's order, so a message sent on the main group waits for the
    decode step in flight, and the follower only learns the next step's ops after its GPU finished the
    last one: the lookahead is lost (measured on two H200s: TP=2 B=1 decode 64 tok/s, against 165 for
    mlx-lm's own sharded stream_generate). A ring group over loopback on the CPU stream carries the
    messages beside the GPU work instead. One host only (NCCL_HOST_IP local); MLXB_TP_COMMANDS=main
    turns it off."""
    env = os.environ
    if backend_name() != "nccl" or env.get("MLXB_TP_COMMANDS") == "main":
        return None
    if env.get("NCCL_HOST_IP", "127.0.0.1") not in ("127.0.0.1", "localhost"):
        return None
    import json
    import tempfile

    port = int(env.get("NCCL_PORT", "12345")) + 101
    path = os.path.join(tempfile.gettempdir(), f"mlxb-tp-commands-{port}-{group.rank()}.json")
    with open(path, "w") as f:
        json.dump([[f"127.0.0.1:{port + r}"] for r in range(group.size())], f)
    saved = env.get("MLX_HOSTFILE")
    env["MLX_HOSTFILE"] = path
    try:
        cmd = mx.distributed.init(strict=True, backend="ring")
        return cmd if cmd.size() == group.size() and cmd.rank() == group.rank() else None
    except Exception:
        return None
    finally:
        if saved is None:
            env.pop("MLX_HOSTFILE", None)
        else:
            env["MLX_HOSTFILE"] = saved


class Link:
    """Rank 0's messages to the other ranks, and in-graph broadcast of sampled tokens."""

    def __init__(self, group):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.cmd = command_group(group)  # messages beside the GPU work (NCCL), else None: the main group
        self.channel = "ring over loopback (CPU)" if self.cmd is not None else "main group"
        self.busy_since: Optional[float] = None  # rank 0: when the mirrored call in progress began
        self.busy_kind = "work"
        self.messages = 0
        self.words = 0

    def _sum(self, a: mx.array) -> mx.array:
        return mx.distributed.all_sum(a, group=self.group)

    def _msg(self, a: mx.array) -> mx.array:
        if self.cmd is None:
            return self._sum(a)
        return mx.distributed.all_sum(a, group=self.cmd, stream=mx.cpu)

    def send(self, words: list[int]) -> None:
        head = words[: HEAD - 1]
        mx.eval(self._msg(mx.array([len(words), *head] + [0] * (HEAD - 1 - len(head)), dtype=mx.int32)))
        if len(words) > HEAD - 1:
            mx.eval(self._msg(mx.array(words[HEAD - 1:], dtype=mx.int32)))
        self.messages += 1
        self.words += len(words)

    def recv(self) -> list[int]:
        head = self._msg(mx.zeros(HEAD, dtype=mx.int32)).tolist()
        n = head[0]
        words = head[1 : 1 + min(n, HEAD - 1)]
        if n > HEAD - 1:
            words += self._msg(mx.zeros(n - HEAD + 1, dtype=mx.int32)).tolist()
        return words

    def agree(self, ok: int) -> int:
        """How many ranks say ``ok`` (1 or 0): every rank calls this at the same point of a message."""
        return int(self._msg(mx.array([int(ok)], dtype=mx.int32)).item())

    def share(self, a: mx.array) -> mx.array:
        """Rank 0's ``a`` (integer tokens) on every rank, as a node of the lazy graph."""
        x = a.astype(mx.int32)
        # NOTE: ``x * 0``, not ``zeros_like(x)``: the zeros must depend on this rank's forward, or the
        # follower's graph runs this all_sum before the forward's own and the ranks deadlock
        return self._sum(x if self.rank == 0 else x * 0).astype(a.dtype)
