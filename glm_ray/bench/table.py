"""Plain-text rows and JSONL output shared by the engine-side benchmarks (offline, orchestration,
fp8_proj_step). The serving benchmark's richer tables live in report.py."""
from __future__ import annotations

import json
from typing import Any, Sequence


def print_rows(rows: Sequence[dict[str, Any]], cols: Sequence[str], width: int = 18) -> None:
    """One header line and one line per row; floats with 3-4 decimals, anything else as `str` (bools and
    None as words), right-aligned; a column a row lacks (an error row) prints as '-'."""
    print(" | ".join(f"{c:>{width}}" for c in cols))
    for r in rows:
        vals = [r.get(c, "-") for c in cols]
        print(" | ".join(f"{v:>{width}.{3 if abs(v) >= 1 else 4}f}" if isinstance(v, float)
                         else f"{v!s:>{width}}" for v in vals))


def append_rows(path: str | None, rows: Sequence[dict[str, Any]]) -> None:
    """Append rows to a JSONL file (no-op without a path)."""
    if not path:
        return
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
