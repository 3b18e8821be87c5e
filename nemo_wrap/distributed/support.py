"""The support matrix: which degrees each strategy takes, and every combination refused.

Printed from the two tables that decide it — the strategy registry and
:data:`nemo_wrap.distributed.combinations.REFUSALS` — so the README (which shows this output, a
test keeps them equal) cannot say something the code does not do.
"""

from __future__ import annotations

from nemo_wrap.distributed.combinations import REFUSALS, Refusal
from nemo_wrap.distributed.degrees import DEGREE_ARGUMENTS
from nemo_wrap.distributed.strategies import strategy_entry, strategy_names


def support_matrix() -> str:
    """The support matrix as two Markdown tables."""
    lines = ["| Strategy | Takes besides data parallel |", "|---|---|"]
    for name in strategy_names():
        degrees = [f"`{DEGREE_ARGUMENTS[degree]}`" for degree in strategy_entry(name).degrees]
        lines.append(f"| `{name}` | {', '.join(degrees) or '—'} |")
    lines += ["", "| This | does not compose with | because | instead |", "|---|---|---|---|"]
    lines += [_row(refusal) for refusal in REFUSALS]
    return "\n".join(lines)


def _row(refusal: Refusal) -> str:
    unless = f" (unless with {', '.join(f.value for f in refusal.unless)})" if refusal.unless else ""
    return f"| {refusal.first.value} | {refusal.second.value}{unless} | {refusal.reason} | {refusal.way_out} |"
