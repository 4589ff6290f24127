"""Display titles of policies and model scales: one home for the grid's cell names
(``Voting-IP-tiny-s-Math``) and the report's labels. A workflow's title is its file's ``title:``
(:func:`marlow.workflows.load.workflow_title`).

It sits with the config whose choices it titles and imports nothing of marlow, so that
``grids.grid``, which names cells, and ``report``, which labels tables and figures, both read the
same titles without the report importing the grid.
"""

from __future__ import annotations

from pathlib import Path

POLICY_TITLES = {"ip": "IP", "sp": "SP", "base": "Base", "sa-rl": "SA", "transfer": "Transfer"}
"""Cell policy -> the title part of a cell name (``Single-SA-tiny-s-Math``)."""

POLICY_LABELS = {"ip": "IP", "sp": "SP", "sa-rl": "SA-RL", "transfer": "Transfer", "base": "Base"}
"""Cell policy -> its label in figures (the paper's legend says SA-RL where names say SA)."""


def scale_title(scale: str) -> str:
    """A scale as cell names show it: tiny scales as they are, a Hugging Face id or path by its
    last part without a ``Qwen3-`` prefix (``Qwen/Qwen3-1.7B`` -> ``1.7B``)."""
    name = Path(scale).name if "/" in scale else scale
    return name.removeprefix("Qwen3-")
