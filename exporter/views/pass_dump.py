"""`b12x export --dump-passes DIR`: the graph of every pass after every rewrite, numbered.

DIR/PASS/00-captured.txt is the graph as captured, DIR/PASS/01-REWRITE.txt after the
first rewrite, and so on, in the node-per-line form of `b12x inspect --graph`, so what a
rewrite did is one `diff` away.
"""

from __future__ import annotations

from pathlib import Path

import torch.fx

from b12x_toolchain.exporter.views.graph_text import graph_text


class PassDump:
    def __init__(self, root):
        self.root = Path(root)

    def write(self, pass_name: str, index: int, stage: str, gm: torch.fx.GraphModule, inputs, outputs=()) -> Path:
        path = self.root / pass_name / f"{index:02d}-{stage}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(graph_text(gm, inputs, list(outputs), f"{pass_name} after {stage}"))
        return path
