"""Request payloads for the load client, built deterministically from a seed: random prompts, an agent fleet
sharing a system prompt, mixed lengths, growing conversations, a coding agent's tool loop, or a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Optional


@dataclass
class Dataset:
    """Request payloads (without model/stream fields) built deterministically. A multi-turn dataset
    holds ``conversations`` instead: each turn is sent after the previous reply arrived, with that
    reply and the next user message appended (the history grows as an agent's does)."""

    name: str
    payloads: list[dict]
    conversations: Optional[list[dict]] = None  # {"messages": [...], "users": [next turns], "extra": {...}}

    def __len__(self) -> int:
        if self.conversations is not None:
            return sum(1 + len(c["users"]) for c in self.conversations)
        return len(self.payloads)

def _random_text(tokenizer, rng: random.Random, n_tokens: int, vocab: int) -> str:
    """Text that the model's tokenizer turns into about ``n_tokens`` ids (decoded random ids)."""
    ids = [rng.randrange(300, vocab - 1) for _ in range(n_tokens)]
    return tokenizer.decode(ids)

def random_dataset(tokenizer, n: int, input_len: int, output_len: int, vocab: int, seed: int = 0,
                   extra: Optional[dict] = None, forced_every: int = 0, tool_choice: str = "required") -> Dataset:
    """Random prompts; ``forced_every`` k > 0: every k-th request carries the agent tools with ``tool_choice``
    (``required``: a forced call, a grammar row beside free ones; ``auto``: the same prompts unconstrained,
    the control that isolates what the grammar rows cost their neighbours)."""
    tools = dict(FORCED_TOOL, tool_choice=tool_choice)
    rng = random.Random(seed)
    return Dataset("random", [
        {"messages": [{"role": "user", "content": _random_text(tokenizer, rng, input_len, vocab)}],
         "max_tokens": output_len, **(extra or {}),
         **(tools if forced_every and i % forced_every == forced_every - 1 else {})} for i in range(n)])

def shared_prefix_dataset(tokenizer, groups: int, prompts_per_group: int, system_len: int, question_len: int,
                          output_len: int, vocab: int, seed: int = 0, extra: Optional[dict] = None) -> Dataset:
    """The agent-fleet shape: each group shares one long system prompt; the questions differ."""
    rng = random.Random(seed)
    out = []
    systems = [_random_text(tokenizer, rng, system_len, vocab) for _ in range(groups)]
    for j in range(prompts_per_group):
        for g in range(groups):
            out.append({"messages": [{"role": "system", "content": systems[g]},
                                     {"role": "user", "content": _random_text(tokenizer, rng, question_len, vocab)}],
                        "max_tokens": output_len, **(extra or {})})
    return Dataset("shared-prefix", out)

def mixed_dataset(tokenizer, n: int, short_len: int, long_len: int, output_len: int, vocab: int, seed: int = 0,
                  extra: Optional[dict] = None) -> Dataset:
    """Short and long prompts alternating (a 50-token row beside a 4k-token row)."""
    rng = random.Random(seed)
    return Dataset("mixed", [
        {"messages": [{"role": "user", "content": _random_text(tokenizer, rng, long_len if i % 2 else short_len, vocab)}],
         "max_tokens": output_len, **(extra or {})} for i in range(n)])

def multi_turn_dataset(tokenizer, conversations: int, turns: int, system_len: int, turn_len: int,
                       output_len: int, vocab: int, seed: int = 0, extra: Optional[dict] = None) -> Dataset:
    """Conversations that grow: a shared system prompt, then per turn the previous reply plus a new
    user message (``turns`` requests per conversation, each sent after the last reply arrived)."""
    rng = random.Random(seed)
    system = _random_text(tokenizer, rng, system_len, vocab)
    convs = []
    for _ in range(conversations):
        users = [_random_text(tokenizer, rng, turn_len, vocab) for _ in range(turns)]
        convs.append({"messages": [{"role": "system", "content": system}, {"role": "user", "content": users[0]}],
                      "users": users[1:], "max_tokens": output_len, "extra": dict(extra or {})})
    return Dataset("multi-turn", [], convs)

AGENT_TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite, or one test file.",
                                      "parameters": {"type": "object", "properties": {"target": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "apply_patch", "description": "Apply a unified diff to the tree.",
                                      "parameters": {"type": "object", "properties": {"patch": {"type": "string"}},
                                                     "required": ["patch"]}}},
]

# a forced call of the agent tools (one call; the model's own tool format, or JSON in <tool_call> tags)
FORCED_TOOL = {"tools": AGENT_TOOLS, "tool_choice": "required", "parallel_tool_calls": False}


def agent_loop_dataset(tokenizer, agents: int, turns: int, system_len: int, task_len: int, tool_len: int,
                       output_len: int, vocab: int, seed: int = 0, extra: Optional[dict] = None) -> Dataset:
    """A coding agent's loop: a shared system prompt and ``tools`` in every request; each agent's first turn is
    its task, and each later turn resends the whole conversation with the last reply as an assistant turn that
    called a tool, then that tool's result (``tool_len`` tokens). ``turns`` requests per agent, each sent
    after the previous reply arrived."""
    rng = random.Random(seed)
    system = _random_text(tokenizer, rng, system_len, vocab)
    convs = []
    for a in range(agents):
        task = _random_text(tokenizer, rng, task_len, vocab)
        steps = []
        for t in range(1, turns):
            tool = AGENT_TOOLS[(a + t) % len(AGENT_TOOLS)]["function"]["name"]
            key = {"read_file": "path", "run_tests": "target", "apply_patch": "patch"}[tool]
            steps.append({"tool_call": {"id": f"call_{a}_{t}", "type": "function",
                                        "function": {"name": tool, "arguments": json.dumps({key: f"src/mod_{a}_{t}.py"})}},
                          "result": _random_text(tokenizer, rng, tool_len, vocab)})
        convs.append({"messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
                      "users": steps, "max_tokens": output_len, "extra": {"tools": AGENT_TOOLS, **(extra or {})}})
    return Dataset("agent-loop", [], convs)

def _follow_up(reply: str, nxt) -> list[dict]:
    """The messages a conversation appends after a reply: a user turn (multi-turn) or the reply as a tool
    call and the tool's result (agent-loop)."""
    if isinstance(nxt, str):
        return [{"role": "assistant", "content": reply}, {"role": "user", "content": nxt}]
    call = nxt["tool_call"]
    return [{"role": "assistant", "content": reply, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": nxt["result"]}]

def jsonl_dataset(path: str, n: Optional[int] = None, default_max_tokens: int = 128) -> Dataset:
    from mlxb.errors import ValidationError

    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValidationError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(d, dict) or not ("messages" in d or "prompt" in d):
                raise ValidationError(f"{path}:{lineno}: each line needs 'messages' or 'prompt'")
            d.setdefault("max_tokens", default_max_tokens)
            out.append(d)
    if not out:
        raise ValidationError(f"{path}: no requests in the file")
    if n:
        out = (out * (n // len(out) + 1))[:n]
    return Dataset("jsonl", out)
