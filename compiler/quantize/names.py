"""Fresh tensor and node names for graphs the quantizer builds or rewrites."""

from __future__ import annotations

import onnx


class FreshNames:
    """Names no tensor or node of a graph uses yet; every name handed out is taken from then on."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.taken = {t.name for t in graph.initializer} | {i.name for i in graph.input}
        self.taken |= {o for n in graph.node for o in n.output} | {n.name for n in graph.node}

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name
