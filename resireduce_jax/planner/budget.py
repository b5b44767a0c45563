"""Per-worker memory budgets: reading a size string, and writing bytes for the tables.

The planner takes budgets in bytes or as sizes such as ``"12GiB"`` or ``"8 GB"``
(:func:`parse_budget`). See docs/design.md, "Memory planning".
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)")
_EXAMPLES = "e.g. '12GiB', '8 GB', '512MiB' or a number of bytes such as 12884901888"


def parse_budget(budget: int | float | str) -> int:
    """A per-worker memory budget in bytes.

    Args:
      budget: bytes (a positive int, or a float with an integral value), or a string: a
        number with an optional unit, ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000)
        or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), case-insensitive, spaces
        allowed: ``"12GiB"``, ``"8 GB"``, ``"1.5gib"``, ``"12884901888"``.

    Returns:
      The budget in bytes (rounded down).

    Raises:
      ValueError: for anything else (a fraction, a percentage, an unknown unit, zero or
        a negative size), with the accepted forms in the message.
    """
    if isinstance(budget, bool):
        raise ValueError(f"a memory budget cannot be a bool, got {budget!r}; {_EXAMPLES}.")
    if isinstance(budget, int):
        value = float(budget)
    elif isinstance(budget, float):
        if not math.isfinite(budget) or budget != int(budget):
            raise ValueError(
                f"a memory budget in bytes must be a whole number, got {budget!r}; {_EXAMPLES}."
            )
        value = budget
    elif isinstance(budget, str):
        text = budget.strip().lower()
        match = _SIZE.fullmatch(text)
        if match is None or (match.group(2) and match.group(2) not in _UNITS):
            hint = ""
            if text.endswith("%"):
                hint = " (percentages are for remat.budget; the planner needs a size)"
            elif match is not None and match.group(2) in ("k", "m", "g", "t", "kb/s"):
                hint = f" ('{match.group(2)}' is ambiguous: write GB or GiB)"
            raise ValueError(f"cannot read the memory budget {budget!r}{hint}; {_EXAMPLES}.")
        value = float(match.group(1)) * _UNITS.get(match.group(2) or "b", 1)
    else:
        raise ValueError(
            f"a memory budget is an int or a string, got {type(budget).__name__}; {_EXAMPLES}."
        )
    if not value >= 1:
        raise ValueError(f"a memory budget must be at least 1 byte, got {budget!r}; {_EXAMPLES}.")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB (from 1 GiB), MiB or KiB with two decimals."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
