"""Request, its status, its sampling parameters and the records it streams back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class RequestStatus(enum.IntEnum):
    WAITING = 0
    PREFILLING = 1
    RUNNING = 2
    SERIAL = 3
    # finished states come after every live state
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class SamplingParams:
    """Per-row sampling; every field is honoured on both mechanisms."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None
    frequency_context_size: int = 20
    logit_bias: Optional[dict[int, float]] = None
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def has_processors(self) -> bool:
        return bool(self.logit_bias) or any(
            p not in (None, 0, 1.0) if name == "repetition_penalty" else p not in (None, 0)
            for name, p in (
                ("repetition_penalty", self.repetition_penalty),
                ("presence_penalty", self.presence_penalty),
                ("frequency_penalty", self.frequency_penalty),
            )
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing per-row: eligible for one batched argmax."""
        return self.temperature == 0 and not self.has_processors and not self.logprobs and not self.top_logprobs


@dataclass
class Timings:
    submitted: float = field(default_factory=time.perf_counter)
    received: Optional[float] = None  # the server's handler got the request (perf_counter; None outside a server)
    prepared: Optional[float] = None  # a prep thread (or the loop) began validating and tokenizing it
    admitted: Optional[float] = None
    prefill_done: Optional[float] = None
    first_token: Optional[float] = None
    finished: Optional[float] = None

    def as_dict(self, num_generated: int) -> dict:
        def d(a, b):
            return None if a is None or b is None else round(b - a, 6)

        decode_s = d(self.first_token, self.finished)
        return {
            "queue_wait_s": d(self.submitted, self.admitted),
            "prefill_s": d(self.admitted, self.prefill_done),
            "ttft_s": d(self.submitted, self.first_token),
            "total_s": d(self.submitted, self.finished),
            "decode_tps": round((num_generated - 1) / decode_s, 3) if decode_s and num_generated > 1 else None,
        }


@dataclass
class Request:
    """One generation request as the engine sees it (already tokenized and validated)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks: generate max_tokens even past EOS
    cache_prompt: bool = True  # False: neither reuse nor store this request's prefix (request field)
    num_draft_tokens: Optional[int] = None  # speculation per request (--spec): 0 turns it off, None: the server's
    adapter: int = -1  # LoRA adapter slot (--adapters; mlxb.adapters.lora), -1: the base model
    on_output: Optional[Callable[[Any], None]] = None  # called on the engine thread; raising evicts the row
    status: RequestStatus = RequestStatus.WAITING
    mechanism: str = "continuous"  # "serial" | "continuous"
    num_generated: int = 0
    cached_tokens: int = 0
    reads_prefix: int = 0  # leading prompt tokens it reads from the batch's live shared prefix from its first chunk
    # prompt lengths where prefill ends a chunk, so that a cache of exact snapshots (recurrent or sliding-window
    # layers) holds one there: a shared system prompt's end (gateway), a prefix shared with cached prompts (reuse)
    snapshot_at: list[int] = field(default_factory=list)
    spec_drafted: Optional[int] = None  # --spec: draft tokens proposed for this row, and kept by the target
    spec_accepted: int = 0
    constraint: Any = None  # mlxb.constrain.grammar.Constraint: this row's grammar matcher (structured outputs)
    requeues: int = 0  # times its prefill ran out of device memory and it went back to the queue
    tool_format: Any = None  # mlxb.constrain.tools.ToolFormat its output's tool calls are parsed with (None: no tools)
    reply_ids: Optional[list] = None  # chat rows under a prompt cache: the generated ids (mlxb.engine.replies)
    timings: Timings = field(default_factory=Timings)
    error: Optional[str] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One streamed record. ``finish_reason`` is set on the last record only."""

    request_id: str
    token: Optional[int]  # None on a final record that carries no new token (EOS, stop string, error)
    text: str
    logprob: Optional[TokenLogprob] = None
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    timings: Optional[dict] = None
    error: Optional[Exception] = None
    stop_sequence: Optional[str] = None  # the stop string that ended the request (last record only)
