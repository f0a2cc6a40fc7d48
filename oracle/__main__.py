"""``python -m mlxb.oracle CASES.jsonl OUT.json [LOADS.json]``: run parity cases with mlx-lm in this process.

``LOADS.json`` maps a case's ``model|dtype`` to the ``[source, dtype]`` to load (a folder is named by its
content in the cases, so the path to it comes from here).

The parity command starts this in its own process, so nothing the engine under test did (its
stream, its caches, its compiled graphs) can leak into the reference.
"""

from __future__ import annotations

import json
import sys

from mlxb.models import load_model
from mlxb.oracle.grouped import correct_masks
from mlxb.oracle.reference import run_case
from mlxb.parity.protocol import Case


def main(argv: list[str]) -> int:
    src, dst = argv[:2]
    loads = json.load(open(argv[2])) if len(argv) > 2 else {}
    cases = [Case.from_dict(json.loads(line)) for line in open(src) if line.strip()]
    models: dict = {}
    out = []
    for i, case in enumerate(cases):
        mkey = (case.model, case.dtype)
        try:
            src = loads.get(f"{case.model}|{case.dtype}", (case.model, case.dtype))
            if mkey not in models or case.lora:  # adapters change the model: a fresh one per lora case
                models.clear()  # one model resident at a time
                models[mkey] = load_model(*src, engine_view=False)[:2]  # mlx-lm's model as shipped
                correct_masks(models[mkey][0])  # mlx-lm's Gemma 2 under a padded batch (grouped.py)
                if case.lora:
                    from mlxb.models.adapters import ensure_adapters
                    from mlxb.oracle.lora import attach

                    models[mkey][0].oracle_lora = attach(models[mkey][0], ensure_adapters(*src, case.model,
                                                                                          case.lora["adapters"]))
            res = run_case(*models[mkey][:1], case, tokenizer=models[mkey][1])
            if case.lora:
                models.clear()
        except Exception as e:  # one case the backend or model cannot run fails alone, with its reason
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300], "records": None}
        out.append({"digest": case.digest(), **res})
        print(f"oracle {i + 1}/{len(cases)}", file=sys.stderr, flush=True)
    with open(dst, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
