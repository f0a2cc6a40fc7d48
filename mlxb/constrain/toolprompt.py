"""Tools on a chat template that does not render them.

Many fine-tunes and base models ship a plain chat loop as their template: ``tools`` passed to it
vanish, an assistant turn's ``tool_calls`` are dropped, and some refuse a ``tool`` turn. The model
would then never learn what it may call. ``TemplateTools.probe`` renders small conversations with
and without those parts once at start-up and records what the template does with them; ``prepare``
then fills each gap in the request's messages:

* tools the template drops: their JSON schemas go into the system turn (appended to the first
  system message, or a new one in front), asking for calls as JSON in ``<tool_call>`` tags, the
  form ``ToolFormat.json_tools()`` parses;
* assistant ``tool_calls`` it drops: written into that turn's text in the same form;
* ``tool`` turns it refuses: sent as user turns holding ``<tool_response>`` blocks.

``tool_prompt=False`` (``mlxb serve --no-tool-prompt``) leaves such templates as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

PROBE = "mlxb_probe_fn"
_PROBE_TOOL = {"type": "function", "function": {"name": PROBE, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}


def addendum(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call the functions below. Their JSON signatures are inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call a function, answer with a JSON object holding its name and its arguments inside "
            "<tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-as-a-JSON-object>}\n</tool_call>')


def call_text(calls: list[dict]) -> str:
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                  ensure_ascii=False) + "\n</tool_call>" for c in calls)


@dataclass
class TemplateTools:
    renders_tools: bool = True
    renders_calls: bool = True
    accepts_tool_turns: bool = True
    tool_prompt: bool = True

    @property
    def adds(self) -> bool:
        """mlxb writes the tools into the prompt itself (the template drops them, the addendum is on)."""
        return self.tool_prompt and not self.renders_tools

    @property
    def mode(self) -> str:
        """'template' (the chat template renders tools), 'addendum' (mlxb adds them) or 'dropped'."""
        return "template" if self.renders_tools else ("addendum" if self.tool_prompt else "dropped")

    @classmethod
    def probe(cls, tokenizer, chat_template: Optional[str] = None, tool_prompt: bool = True) -> "TemplateTools":
        kw = {"chat_template": chat_template} if chat_template else {}

        def render(msgs, **extra) -> Optional[str]:
            try:
                out = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw, **extra)
            except Exception:
                return None
            return out if isinstance(out, str) else None

        user = [{"role": "user", "content": "hi"}]
        if getattr(tokenizer, "chat_template", None) is None and not chat_template:
            return cls(False, False, False, tool_prompt)
        with_tools = render(user, tools=[_PROBE_TOOL])
        call = {"id": "call_probe", "type": "function", "function": {"name": PROBE, "arguments": {}},
                "name": PROBE, "arguments": {}}
        with_call = render(user + [{"role": "assistant", "content": "", "tool_calls": [call]}]
                           + [{"role": "user", "content": "ok"}])
        with_turn = render(user + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": "call_probe", "content": "done"}])
        return cls(renders_tools=with_tools is not None and PROBE in with_tools,
                   renders_calls=with_call is not None and PROBE in with_call,
                   accepts_tool_turns=with_turn is not None, tool_prompt=tool_prompt)

    def prepare(self, msgs: list[dict], tools: Optional[list[dict]]) -> tuple[list[dict], Optional[list[dict]]]:
        """(messages, tools for the template): the gaps this template leaves filled in."""
        if not self.tool_prompt:
            return msgs, tools
        out = []
        for m in msgs:
            if m["role"] == "assistant" and m.get("tool_calls") and not self.renders_calls:
                text, calls = m.get("content") or "", m["tool_calls"]
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = (text + "\n" if text else "") + call_text(calls)
            elif m["role"] == "tool" and not self.accepts_tool_turns:
                m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            out.append(m)
        if tools and not self.renders_tools:
            extra = addendum(tools)
            if out and out[0]["role"] == "system":
                out[0] = dict(out[0], content=(out[0]["content"] + "\n\n" if out[0]["content"] else "") + extra)
            else:
                out.insert(0, {"role": "system", "content": extra})
            tools = None
        return out, tools

    def card(self) -> dict[str, Any]:
        return {"tools_in_template": self.renders_tools, "tool_prompt": self.mode}

