"""The ``lookup`` proposer (prompt lookup, n-gram copy from the row's own history)."""

from __future__ import annotations

import numpy as np


class LookupProposer:
    """Prompt lookup (n-gram copy): find the most recent earlier occurrence of the history's last n
    tokens (n from ``ngram`` down to 1) that is followed by k tokens (else the most recent one) and
    propose the tokens that followed it."""

    def __init__(self, ngram: int = 3):
        self.ngram = ngram

    shadows = True  # a plain step can check its drafts against what follows for free (spec_control.shadow)

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        """The match is searched from the positions that hold the last token (one vectorized compare),
        narrowed token by token: the same windows as comparing every n-gram, at a fraction of the host
        time (it runs on every step of every speculating row)."""
        n_hist = history.shape[0]
        if k <= 0 or n_hist < 2:
            return []
        ends = np.flatnonzero(history[:-1] == history[-1])  # where an earlier window could end
        for n in range(min(self.ngram, n_hist - 1), 0, -1):
            e = ends[ends >= n - 1]
            for d in range(1, n):
                if not e.size:
                    break
                e = e[history[e - d] == history[-1 - d]]
            if e.size:  # the latest match that is followed by k tokens, else the latest match
                hits = e - (n - 1)
                full = hits[hits + n + k <= n_hist]
                s = int(full[-1] if full.size else hits[-1]) + n
                return history[s : s + k].tolist()
        return []
