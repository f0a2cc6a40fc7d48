"""Tool-call spans found in streamed text with mlx-lm's json_tools parser."""

import json

from mlx_lm.tool_parsers import json_tools

from mlxb.constrain.tools import ToolFormat
from mlxb.server.toolcalls import ToolCallStream, split

FMT = ToolFormat(json_tools.parse_tool_call, json_tools.tool_call_start, json_tools.tool_call_end, "json_tools")
TEXT = 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>and<tool_call>{"name": "g", "arguments": {}}</tool_call>'


def test_split_whole_text():
    content, calls = split(FMT, None, TEXT)
    assert content == "Sure.and"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" and "index" not in c for c in calls)


def test_every_chunking_gives_the_same_events():
    want = split(FMT, None, TEXT)
    for size in (1, 2, 3, 5, 7, 11):
        s = ToolCallStream(FMT, None)
        content, calls = [], []
        for i in range(0, len(TEXT), size):
            for kind, v in s.feed(TEXT[i:i + size]):
                (content.append(v) if kind == "content" else calls.extend(v))
        for kind, v in s.finish():
            (content.append(v) if kind == "content" else calls.extend(v))
        assert "".join(content) == want[0]
        assert [c["index"] for c in calls] == [0, 1]
        assert [c["function"] for c in calls] == [c["function"] for c in want[1]]


def test_unparsable_or_open_spans_stay_text():
    assert split(FMT, None, "a<tool_call>not json</tool_call>b") == ("a<tool_call>not json</tool_call>b", [])
    content, calls = split(FMT, None, 'x<tool_call>{"name": "f", "arguments": {}}')  # cut before the end tag
    assert content == "x" and calls[0]["function"]["name"] == "f"
    assert split(FMT, None, "x<tool_call>{\"na") == ("x<tool_call>{\"na", [])
    assert split(FMT, None, "just text <tool") == ("just text <tool", [])
