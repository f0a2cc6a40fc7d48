"""Generated ids for assistant turns sent back, so a conversation's next turn starts where its last one ended.

An agent resends its conversation with the model's last reply as an assistant message. Tokenizing that text
again need not give the ids the model generated (a random-weight model emits byte fragments; a trained one
can produce a sequence the tokenizer would merge otherwise), and then the prompt cache's hit, which holds
prompt + generated ids of the finished row, ends inside the reply and the next turn prefills the reply again.

So finished chat rows' ids are remembered by their text (``finished``: an append on the engine thread;
decoded later, on the gateway's side). When a chat prompt has an assistant message whose content is such a
text, the prompt is tokenized in pieces around it with the remembered ids in its place (``splice``). Only
where that is safe:
* the template renders the content verbatim (a render with stand-ins, filled back in, equals the real one);
* the text before the first remembered reply tokenizes to the start of the ordinary tokenization, so every
  prompt that shares that start still shares its cached prefix.
Anything else keeps the ordinary tokenization. The pieces between replies are tokenized on their own.

An agent's turn N+1 repeats turn N's pieces and adds one (the last reply's tool result): pieces are tokenized
once and kept by their text (``PIECES`` of them), and the check of the first piece against the ordinary
tokenization is made once per (first piece, first reply). A spliced prompt then costs two renders and the
tokenization of its new piece, and the ordinary tokenization (given lazily, as a callable) is never made.
On an H200 agent loop, 32 turns arriving together were tokenized one after another ~6 ms apart on the event
loop (``reports/h200/session47/agentloop-after``: requests' ``made`` stamps in the trace).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict, deque
from typing import Callable, Optional, Union

CAPACITY = 4096  # remembered replies (texts), least recently used first out
PIECES = 2048  # tokenized pieces between replies, by their text, least recently used first out


class ReplyIds:
    def __init__(self, tokenizer, eos_ids: Optional[set] = None, capacity: int = CAPACITY):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids or [])
        self.capacity = capacity
        self._pending: deque = deque(maxlen=capacity)  # appended on the engine thread, read by the gateway
        self._by_text: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.spliced = 0  # prompts that took remembered ids
        self.replies_spliced = 0
        self._pieces: OrderedDict = OrderedDict()  # piece text -> its ids (add_special_tokens=False)
        self._starts: dict = {}  # (first piece, first reply) -> whether that piece starts the ordinary ids
        self._pieces_lock = threading.Lock()
        self.piece_hits = 0

    def finished(self, ids: list[int]) -> None:
        """A chat row finished (EOS or max_tokens, no stop string) with these generated ids; engine thread."""
        self._pending.append(ids)

    def _absorb(self) -> None:
        while self._pending:
            ids = [t for t in self._pending.popleft()]
            while ids and ids[-1] in self.eos_ids:
                ids.pop()
            if not ids:
                continue
            for text in self._texts(ids):
                self._by_text[text] = ids
                self._by_text.move_to_end(text)
        while len(self._by_text) > self.capacity:
            self._by_text.popitem(last=False)

    def _texts(self, ids: list[int]) -> set:
        """The texts a client may send back for these generated ids: ``decode(ids)``, and what the server streamed,
        which mlx-lm's streaming detokenizers make (they drop the space that opens a reply's first token, so an
        agent's resent reply began without it and was never found: half the turns of a random-weight agent loop
        prefilled their last reply again)."""
        texts = {self.tokenizer.decode(ids)}
        if hasattr(type(self.tokenizer), "detokenizer"):
            try:
                detok = self.tokenizer.detokenizer
                for t in ids:
                    detok.add_token(t)
                detok.finalize()
                texts.add(detok.text)
            except Exception:  # a tokenizer without a working streaming detokenizer: decode's text alone
                pass
        return {t for t in texts if t}

    def _encode(self, piece: str) -> list[int]:
        with self._pieces_lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                self.piece_hits += 1
                return ids
        ids = list(self.tokenizer.encode(piece, add_special_tokens=False))
        with self._pieces_lock:
            self._pieces[piece] = ids
            while len(self._pieces) > PIECES:
                self._pieces.popitem(last=False)
        return ids

    def splice(self, messages: list[dict], kwargs: dict,
               ids: Union[list[int], Callable[[], list[int]]]) -> list[int]:
        """The prompt's ids with remembered replies' generated ids in place of their re-tokenized text, where
        that is safe (module notes); else the ordinary tokenization of ``messages``: ``ids``, given as a list
        or as a callable that makes it (called only when it is needed)."""
        made: list = []

        def ordinary() -> list[int]:
            if not made:
                made.append(list(ids()) if callable(ids) else ids)
            return made[0]

        with self._lock:
            self._absorb()
            hits = [i for i, m in enumerate(messages) if m.get("role") == "assistant"
                    and isinstance(m.get("content"), str) and m["content"] in self._by_text]
            if not hits:
                return ordinary()
            replies = {i: self._by_text[messages[i]["content"]] for i in hits}
            for i in hits:
                self._by_text.move_to_end(messages[i]["content"])
        marks = {i: f"\x00mlxb-reply-{k}\x00" for k, i in enumerate(hits)}
        stand_in = [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            shown = self.tokenizer.apply_chat_template(stand_in, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception:
            return ordinary()
        if not isinstance(shown, str) or any(shown.count(marks[i]) != 1 for i in hits):
            return ordinary()
        refilled = shown
        for i in hits:
            refilled = refilled.replace(marks[i], messages[i]["content"], 1)
        if refilled != text:  # the template changed the content (trimmed it, say): keep the ordinary ids
            return ordinary()
        pieces = re.split("(" + "|".join(re.escape(m) for m in marks.values()) + ")", shown)
        which = {m: i for i, m in marks.items()}
        out: list[int] = []
        for k, piece in enumerate(pieces):
            if piece in which:
                out += replies[which[piece]]
            elif piece:
                enc = self._encode(piece)
                if k == 0:  # the start must be the ordinary tokenization's (checked once per conversation)
                    key = (piece, messages[hits[0]]["content"])
                    ok = self._starts.get(key)
                    if ok is None:
                        ok = ordinary()[:len(enc)] == enc
                        with self._pieces_lock:
                            self._starts[key] = ok
                            while len(self._starts) > PIECES:
                                self._starts.pop(next(iter(self._starts)))
                    if not ok:
                        return ordinary()
                out += enc
        with self._lock:
            self.spliced += 1
            self.replies_spliced += len(hits)
        return out

    def stats(self) -> dict:
        with self._lock:
            self._absorb()
            return {"remembered": len(self._by_text), "prompts_spliced": self.spliced,
                    "replies_spliced": self.replies_spliced, "pieces_reused": self.piece_hits}
