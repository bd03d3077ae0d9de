"""Integer op lowerings, one module per op family (modelled on onnx.reference.ops).

`LOWERINGS` maps an ONNX op type (default domain, or a contrib op listed in `CONTRIB_OPS`) to
the function that turns an `OpContext` into a `Lowered` kernel. `FUSES_ACTIVATION` lists the ops whose following Relu/Clip folds into
their output clamp, `INDEX_OUTPUTS` the ops whose output is unquantized indices.
"""

from __future__ import annotations

from compiler.runtime.ops import (
    conv,
    elementwise,
    grid_sample,
    lut,
    matmul,
    movement,
    normalization,
    pool,
    reduce,
    resize,
    softmax,
)
from compiler.runtime.ops.base import Lowered, OpContext
from surgery.targets import CONTRIB_OPS, placeable_domain

LOWERINGS = {
    **conv.LOWERINGS,
    **matmul.LOWERINGS,
    **elementwise.LOWERINGS,
    **lut.LOWERINGS,
    **pool.LOWERINGS,
    **reduce.LOWERINGS,
    **movement.LOWERINGS,
    **resize.LOWERINGS,
    **softmax.LOWERINGS,
    **normalization.LOWERINGS,
    **grid_sample.LOWERINGS,
}

BF16_LOWERINGS = {**grid_sample.BF16_LOWERINGS, **movement.BF16_LOWERINGS}
"""Lowerings of the ops the QDQ model runs in bf16 (Cast pairs to bfloat16 around them)."""

lowerable_domain = placeable_domain
"""The lowering registered for an op type serves a node of that domain (`CONTRIB_OPS`)."""


FUSES_ACTIVATION = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "BatchNormalization",
        "MatMul",
        "Gemm",
        "Add",
        "Sub",
        "Sum",
        "Mul",
        "Div",
    }
)
"""Ops with an output stage that can clamp: Relu/Clip between them and the QuantizeLinear fuse."""

RANKED_OPS = frozenset({"BatchNormalization"})
"""Ops whose lowering needs its inputs' ranks (`OpContext.ranks`): the kernel's weight has one
axis per input axis."""

INDEX_OUTPUTS = frozenset({"ArgMax"})
"""Ops whose output is integer indices, not a quantized value: no QuantizeLinear follows them."""

FUSES_BIAS = frozenset({"MatMul"})
"""Ops without a bias input whose following Add of a constant folds into the accumulator."""

__all__ = [
    "BF16_LOWERINGS",
    "CONTRIB_OPS",
    "FUSES_ACTIVATION",
    "FUSES_BIAS",
    "INDEX_OUTPUTS",
    "RANKED_OPS",
    "LOWERINGS",
    "Lowered",
    "OpContext",
    "lowerable_domain",
]
