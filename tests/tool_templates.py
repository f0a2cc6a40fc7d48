"""Small chat templates in the shape of each tool-call family mlx-lm knows (and Llama 3's JSON, and a
plain chat loop without tools), and model folders that carry them.

Each template is ChatML around the family's own call syntax: the tool list in the system turn, an
assistant turn's ``tool_calls`` written the way that family writes them, tool results in tool turns.
They hold the markers mlx-lm's ``_infer_tool_parser`` looks for (or name the parser in
``tool_parser_type`` where mlx-lm infers it from the vocabulary), so the folder loads with that
family's parser. No hub download: the folders reuse a synthetic model's weights and tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

_HEAD = (
    "{%- if tools %}{{ '<|im_start|>system\n# Tools\n' }}{%- for t in tools %}{{ (t | tojson) + '\n' }}{%- endfor %}"
    "{{ 'Call them like this: ' + @@HINT@@ + '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' }}{%- if message['content'] %}{{ message['content'] }}{%- endif %}"
    "@@OPEN@@{%- for tc in message['tool_calls'] %}{%- set tool_call = tc['function'] if tc.get('function') else tc %}"
    "@@CALL@@{%- endfor %}@@CLOSE@@{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}{{ '<|im_start|>tool\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
_V = "(v if v is string else (v | tojson))"  # an argument value written as text (strings bare)
_ARGS = "(tool_call.arguments | tojson)"


def _t(call: str, hint: str, open_: str = "", close: str = "") -> str:
    return (_HEAD.replace("@@HINT@@", repr(hint)).replace("@@OPEN@@", open_).replace("@@CALL@@", call)
            .replace("@@CLOSE@@", close))


def _kv(open_k: str, mid: str, close_v: str, value: str = _V) -> str:
    return ("{%- for k, v in tool_call.arguments.items() %}{{ '" + open_k + "' + k + '" + mid + "' + " + value
            + " + '" + close_v + "' }}{%- endfor %}")


FAMILIES = {
    # name: (chat template, tokenizer_config extra)
    "json_tools": (_t("{{ '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + " + _ARGS
                      + " + '}\n</tool_call>' }}", "<tool_call>"), {}),
    "qwen3_coder": (_t("{{ '<tool_call>\n<function=' + tool_call.name + '>\n' }}"
                       + _kv("<parameter=", ">\n", "\n</parameter>\n") + "{{ '</function>\n</tool_call>' }}",
                       "<tool_call>\n<function=name>"), {}),
    "glm47": (_t("{{ '<tool_call>' + tool_call.name }}" + _kv("<arg_key>", "</arg_key><arg_value>", "</arg_value>")
                 + "{{ '</tool_call>' }}", "<tool_call>name<arg_key>"), {}),
    "laguna": (_t("{{ '<tool_call>' + tool_call.name }}" + _kv("<arg_key>", "</arg_key><arg_value>", "</arg_value>")
                  + "{{ '</tool_call>' }}", "<tool_call>name<arg_key>"), {"tool_parser_type": "laguna"}),
    "longcat": (_t("{{ '<longcat_tool_call>' + tool_call.name }}"
                   + _kv("<longcat_arg_key>", "</longcat_arg_key><longcat_arg_value>", "</longcat_arg_value>")
                   + "{{ '</longcat_tool_call>' }}", "<longcat_tool_call>"), {}),
    "minimax_m2": (_t("{{ '<invoke name=\"' + tool_call.name + '\">' }}"
                      + _kv('<parameter name="', '">', "</parameter>") + "{{ '</invoke>' }}",
                      "<minimax:tool_call>", "{{ '<minimax:tool_call>\n' }}", "{{ '\n</minimax:tool_call>' }}"), {}),
    "minicpm5": (_t("{{ '<function name=\"' + tool_call.name + '\">' }}" + _kv('<param name="', '">', "</param>")
                    + "{{ '</function>' }}", '<function name="f"><param name="p">'), {}),
    "muse_spark": (_t("{{ '<atem:invoke name=\"' + tool_call.name + '\">' }}"
                      + _kv('<atem:parameter name="', '">', "</atem:parameter>", "(v | tojson)")
                      + "{{ '</atem:invoke>' }}", "<atem:function_calls>", "{{ '<atem:function_calls>' }}",
                      "{{ '</atem:function_calls>' }}"), {}),
    "kimi_k2": (_t("{{ '<|tool_call_begin|>functions.' + tool_call.name + ':' + (loop.index0 | string)"
                   " + '<|tool_call_argument_begin|>' + " + _ARGS + " + '<|tool_call_end|>' }}",
                   "<|tool_calls_section_begin|>", "{{ '<|tool_calls_section_begin|>' }}",
                   "{{ '<|tool_calls_section_end|>' }}"), {}),
    "kimi_k3": (_t("{{ '<|open|>call tool=\"' + tool_call.name + '\" index=\"' + (loop.index | string) + '\"<|sep|>"
                   "<|open|>json type=\"object\"<|sep|>' + " + _ARGS + " + '<|close|>json<|sep|><|close|>call<|sep|>' }}",
                   "XTML calls", "{{ '<|open|>tools<|sep|>' }}", "{{ '<|close|>tools<|sep|>' }}"),
                {"tool_parser_type": "kimi_k3"}),
    "mistral": (_t("{{ '{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + " + _ARGS + " + '}' }}"
                   "{%- if not loop.last %}{{ ', ' }}{%- endif %}", "[TOOL_CALLS]", "{{ '[TOOL_CALLS][' }}",
                   "{{ ']' }}"), {}),
    "mistral_args": (_t("{{ '[TOOL_CALLS]' + tool_call.name + '[ARGS]' + " + _ARGS + " }}",
                        "[TOOL_CALLS]name[ARGS]{...}"), {}),
    "pythonic": (_t("{{ tool_call.name + '(' }}{%- for k, v in tool_call.arguments.items() %}{{ k + '=' + (v | tojson) }}"
                    "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ ')' }}"
                    "{%- if not loop.last %}{{ ', ' }}{%- endif %}",
                    "<|tool_call_start|>[f(a=1)]<|tool_call_end|>", "{{ '<|tool_call_start|>[' }}",
                    "{{ ']<|tool_call_end|>' }}"), {}),
    "function_gemma": (_t("{{ '<start_function_call>call:' + tool_call.name + '{' }}"
                          "{%- for k, v in tool_call.arguments.items() %}{{ k + ':' }}{%- if v is string %}"
                          "{{ '<escape>' + v + '<escape>' }}{%- else %}{{ v | tojson }}{%- endif %}"
                          "{%- if not loop.last %}{{ ',' }}{%- endif %}{%- endfor %}{{ '}<end_function_call>' }}",
                          "<start_function_call>"), {}),
    "gemma4": (_t("{{ '<|tool_call>call:' + tool_call.name + '{' }}"
                  "{%- for k, v in tool_call.arguments.items() %}{{ k + ':' }}{%- if v is string %}"
                  "{{ '<|\"|>' + v + '<|\"|>' }}{%- else %}{{ v | tojson }}{%- endif %}"
                  "{%- if not loop.last %}{{ ',' }}{%- endif %}{%- endfor %}{{ '}<tool_call|>' }}",
                  "<|tool_call>call:f{}<tool_call|>"), {}),
    # gpt-oss's harmony calls as its template writes them (the recipient in the role header); the model itself
    # opens a call in the channel header, which the forced grammar writes
    "harmony": (_t("{{ '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json<|message|>' + "
                   + _ARGS + " + '<|call|>' }}", "<|start|>assistant<|channel|>commentary to=functions.NAME "
                   "<|constrain|>json<|message|>{...}<|call|>"), {}),
    "llama3_json": (_t("{{ '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' + " + _ARGS + " + '}' }}"
                       "{%- if not loop.last %}{{ '; ' }}{%- endif %}",
                       '{"name": function name, "parameters": dictionary of argument name and its value}'), {}),
}

# a plain chat loop: no tool section, assistant tool_calls and tool turns are dropped or refused
PLAIN = ("{%- for message in messages %}"
         "{%- if message['role'] not in ('system', 'user', 'assistant') %}"
         "{{ raise_exception('roles must be system, user or assistant') }}{%- endif %}"
         "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
         "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")


def folder_with_template(base: Path, out: Path, template: str, extra: dict | None = None) -> Path:
    """A copy of model folder ``base`` (weights linked, not copied) whose chat template is ``template`` (a
    template file of the base folder, which would win over tokenizer_config.json, is left out)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        dst = out / f.name
        if f.name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json") or dst.exists():
            continue
        if f.suffix == ".safetensors":
            os.symlink(f.resolve(), dst)
        elif f.is_file():
            shutil.copyfile(f, dst)
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    cfg.pop("tool_parser_type", None)  # the base's parser (mlx_lm.convert writes the one it inferred) is not this template's
    cfg.update(extra or {})
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def family_folder(base: Path, root: Path, family: str) -> Path:
    if family == "plain":
        return folder_with_template(base, root / "plain", PLAIN)
    template, extra = FAMILIES[family]
    return folder_with_template(base, root / family, template, extra)
