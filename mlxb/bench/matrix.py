"""Feature-matrix files (``matrices/*.toml``): parsing with errors that name the line."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mlxb.errors import ValidationError

DATASETS = {"random": {"input_len"}, "shared-prefix": {"system_len", "question_len"},
            "mixed": {"short_len", "long_len"}, "multi-turn": {"system_len", "turn_len"},
            "agent-loop": {"system_len", "turn_len", "tool_len"}}
GATES = {"top_logprobs_5", "json_schema_valid"}
CELL_KEYS = {"name", "server_args", "description", "dataset", "params", "needs", "gates", "concurrency", "requests_per_slot",
             "output_len", "input_len", "system_len", "question_len", "short_len", "long_len", "groups",
             "turn_len", "turns", "tool_len", "adapters", "adapter_rank"}
DEFAULT_KEYS = {"concurrency", "requests_per_slot", "output_len", "repeats"}


@dataclass
class Cell:
    name: str
    dataset: str
    lengths: dict
    description: str = ""
    params: dict = field(default_factory=dict)
    needs: list = field(default_factory=list)
    gates: list = field(default_factory=list)
    concurrency: list = field(default_factory=lambda: [1, 4, 8])
    requests_per_slot: int = 2
    output_len: int = 64
    requests: Optional[int] = None  # fixed request count per level (bench load); else concurrency x per-slot
    server_args: list = field(default_factory=list)  # flags every stack starts with for this cell
    adapters: int = 0  # LoRA: random-weight adapters built for the model; requests cycle through them by folder
    adapter_rank: int = 8  # their LoRA rank (every linear layer of every block)
    adapter_folders: list = field(default_factory=list)  # set when the cell runs (mlxb.models.adapters)


# server flags a cell may set: both stacks take them under the same name and meaning
SERVER_ARGS = {"--kv-bits", "--kv-group-size", "--quantized-kv-start", "--draft-model", "--num-draft-tokens"}
MODEL_ARGS = {"--draft-model"}  # values are model references, resolved to folders before the stacks start


@dataclass
class Matrix:
    path: str
    cells: list[Cell]
    repeats: int = 2


def _line_of(text: str, name: str) -> Optional[int]:
    for i, line in enumerate(text.splitlines(), 1):
        if re.match(rf'\s*name\s*=\s*"{re.escape(name)}"', line):
            return i
    return None


def parse(path: Path | str, text: Optional[str] = None) -> Matrix:
    path = Path(path)
    text = path.read_text() if text is None else text
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValidationError(f"{path}: {e}") from None  # tomllib's message names line and column
    extra = set(data) - {"defaults", "cell"}
    if extra:
        raise ValidationError(f"{path}: unknown top-level key(s) {', '.join(sorted(extra))}; use [defaults] and [[cell]]")
    d = data.get("defaults", {})
    bad = set(d) - DEFAULT_KEYS
    if bad:
        raise ValidationError(f"{path}: [defaults] has unknown key(s) {', '.join(sorted(bad))}")
    cells, seen = [], set()
    for i, raw in enumerate(data.get("cell", [])):
        name = raw.get("name")
        where = f"{path}: cell {i + 1}" if not name else f"{path}:{_line_of(text, name) or '?'}: cell {name!r}"
        if not name:
            raise ValidationError(f"{where} has no name")
        if name in seen:
            raise ValidationError(f"{where}: duplicate cell name")
        seen.add(name)
        bad = set(raw) - CELL_KEYS
        if bad:
            raise ValidationError(f"{where}: unknown key(s) {', '.join(sorted(bad))}")
        ds = raw.get("dataset", "random")
        if ds not in DATASETS:
            raise ValidationError(f"{where}: dataset {ds!r} is not one of {', '.join(DATASETS)}")
        lengths = {k: raw[k] for k in ("input_len", "system_len", "question_len", "short_len", "long_len", "groups",
                                       "turn_len", "turns", "tool_len") if k in raw}
        missing = DATASETS[ds] - set(lengths)
        if missing:
            raise ValidationError(f"{where}: dataset {ds!r} needs {', '.join(sorted(missing))}")
        for k, v in lengths.items():
            if not isinstance(v, int) or v < 1:
                raise ValidationError(f"{where}: {k} must be a positive integer")
        gates = list(raw.get("gates", []))
        if set(gates) - GATES:
            raise ValidationError(f"{where}: unknown gate(s) {', '.join(sorted(set(gates) - GATES))}; gates: "
                                  f"{', '.join(sorted(GATES))}")
        conc = raw.get("concurrency", d.get("concurrency", [1, 4, 8]))
        if not isinstance(conc, list) or not conc or not all(isinstance(c, int) and c >= 1 for c in conc):
            raise ValidationError(f"{where}: concurrency must be a list of positive integers")
        params = raw.get("params", {})
        if not isinstance(params, dict):
            raise ValidationError(f"{where}: params must be a table of request fields")
        args = raw.get("server_args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValidationError(f"{where}: server_args must be a list of strings, e.g. [\"--kv-bits\", \"4\"]")
        named = [a for a in args if a.startswith("--")]
        if set(named) - SERVER_ARGS:
            raise ValidationError(f"{where}: server_args {', '.join(sorted(set(named) - SERVER_ARGS))} not allowed; "
                                  f"a cell may set {', '.join(sorted(SERVER_ARGS))} (both stacks take them)")
        adapters = raw.get("adapters", 0)
        if not isinstance(adapters, int) or not 0 <= adapters <= 64:
            raise ValidationError(f"{where}: adapters must be an integer from 0 to 64 (LoRA adapters to mix)")
        rank = raw.get("adapter_rank", 8)
        if not isinstance(rank, int) or not 1 <= rank <= 256 or ("adapter_rank" in raw and not adapters):
            raise ValidationError(f"{where}: adapter_rank must be an integer from 1 to 256, with adapters set")
        cells.append(Cell(name, ds, lengths, raw.get("description", ""), params, list(raw.get("needs", [])), gates,
                          conc, int(raw.get("requests_per_slot", d.get("requests_per_slot", 2))),
                          int(raw.get("output_len", d.get("output_len", 64))), server_args=list(args),
                          adapters=adapters, adapter_rank=rank))
    if not cells:
        raise ValidationError(f"{path}: no [[cell]] entries")
    return Matrix(str(path), cells, int(d.get("repeats", 2)))
