"""Speculation settings (``--spec lookup|draft``, ``--num-draft-tokens``, ``--spec-max-batch``, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mlxb.spec.ahead import MODES as PIPELINE_MODES

METHODS = ("lookup", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """``--spec lookup --num-draft-tokens K --lookup-ngram N``."""

    method: str = "lookup"
    num_draft_tokens: int = 4
    lookup_ngram: int = 3
    draft_model: Any = field(default=None, compare=False, repr=False)  # the loaded model (--spec draft)
    draft_name: Optional[str] = None
    max_batch: int = 1  # speculate only while the batch has at most this many rows (--spec-max-batch)
    adaptive: bool = True  # False (--spec-fixed): every row drafts num_draft_tokens each step, as mlx-lm does
    pipeline: str = "off"  # --spec-pipeline: a lone row's next verify step launched before this one is read

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--spec {self.method}: choose one of {', '.join(METHODS)}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("--spec draft needs --draft-model (and --draft-model needs --spec draft)")
        if self.max_batch < 1:
            raise ValueError("--spec-max-batch must be at least 1")
        if not 1 <= self.num_draft_tokens <= 32:
            raise ValueError("--num-draft-tokens must be between 1 and 32")
        if self.pipeline not in PIPELINE_MODES:
            raise ValueError(f"--spec-pipeline {self.pipeline}: choose one of {', '.join(PIPELINE_MODES)}")
        if not 1 <= self.lookup_ngram <= 16:
            raise ValueError("--lookup-ngram must be between 1 and 16")
