"""The float32 BLAS time of a model's dense multiply-accumulates: a floor for a numpy emulator.

An emulator written with numpy has to compute every convolution and matrix product of the
model; the fastest exact way numpy offers is a float32 (or float64) BLAS GEMM on integer
codes. This module times exactly those GEMMs — nothing else: no im2col, no requantization, no
depthwise convolutions, no data movement — on random data of the model's shapes. The result is
a lower bound on any numpy emulator of the model. ONNX Runtime runs the same QDQ model with
int8 kernels that fuse the requantization into the GEMM, so when this floor alone exceeds a
multiple of ONNX Runtime's time, no numpy emulator can meet that multiple.

    python bench/blas_floor.py MODEL.onnx [--repeat 5]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import shape_inference


@dataclass(frozen=True)
class Gemm:
    """One batched product [batch, rows, depth] @ [batch, depth, cols] of a model node."""

    node: str
    batch: int
    rows: int
    depth: int
    cols: int

    @property
    def macs(self) -> int:
        return self.batch * self.rows * self.depth * self.cols


def _shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    inferred = shape_inference.infer_shapes(model)
    graph = inferred.graph
    shapes = {
        info.name: [d.dim_value for d in info.type.tensor_type.shape.dim]
        for info in [*graph.input, *graph.value_info, *graph.output]
    }
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _weight_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """Every tensor's shape, a DequantizeLinear's output taking its quantized initializer's."""
    weights = dict(shapes)
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in shapes:
            weights[node.output[0]] = shapes[node.input[0]]
    return weights


def dense_gemms(model: onnx.ModelProto) -> list[Gemm]:
    """The GEMMs of the model's Conv (groups with more than one input channel), MatMul and Gemm
    nodes, as im2col would shape them. Depthwise convolutions are left out (no GEMM)."""
    shapes = _shapes(model)
    weights = _weight_shapes(model, shapes)
    gemms = []
    for node in model.graph.node:
        out = shapes.get(node.output[0], [])
        if node.op_type == "Conv":
            weight = weights.get(node.input[1], [])
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            if len(weight) < 3 or len(out) < 3 or weight[1] == 1:
                continue
            rows = out[0] * math.prod(out[2:])
            depth = weight[1] * math.prod(weight[2:])
            gemms.append(Gemm(node.name, group, rows, depth, weight[0] // group))
        elif node.op_type in ("MatMul", "Gemm"):
            a = shapes.get(node.input[0], [])
            b = weights.get(node.input[1], [])
            if len(a) < 2 or len(b) < 2 or not out:
                continue
            depth = a[-1] if node.op_type == "MatMul" else b[0]
            batch = math.prod(out[:-2]) if len(out) > 2 else 1
            gemms.append(Gemm(node.name, batch, out[-2], depth, out[-1]))
    return gemms


def blas_floor_seconds(model: onnx.ModelProto, repeat: int = 5) -> tuple[float, int]:
    """(best time of all the model's dense GEMMs in float32 BLAS, their MACs)."""
    rng = np.random.default_rng(0)
    operands = [
        (
            rng.integers(-128, 128, (g.batch, g.rows, g.depth)).astype(np.float32),
            rng.integers(-127, 128, (g.batch, g.depth, g.cols)).astype(np.float32),
            np.empty((g.batch, g.rows, g.cols), np.float32),
        )
        for g in dense_gemms(model)
    ]
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for a, b, out in operands:
            np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - started)
    macs = sum(int(a.shape[0]) * a.shape[1] * a.shape[2] * b.shape[2] for a, b, _ in operands)
    return (best if operands else 0.0), macs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    seconds, macs = blas_floor_seconds(onnx.load(args.model), args.repeat)
    print(f"{macs / 1e6:.1f} M dense MACs in float32 BLAS: {seconds * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
