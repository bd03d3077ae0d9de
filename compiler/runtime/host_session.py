"""ONNX Runtime sessions for the float parts of a pipeline: host stages and float islands.

One configuration for both, so a float op gives the same bits in an archive's host stage and in
the reference executor that checks it: no graph optimisations (they fuse and reorder float
arithmetic), and idle intra-op threads that do not spin (they would hold the cores the MLA
stage that follows runs its threads on, `compiler.runtime.parallel`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference


def host_session(model_bytes: bytes) -> Any:
    """An InferenceSession for a serialized model, configured as described above."""
    import onnxruntime as ort

    from surgery.verify import quiet_session_options

    options = quiet_session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def single_node_session(
    node: onnx.NodeProto,
    opsets: dict[str, int],
    feeds: dict[str, np.ndarray],
    constants: Mapping[str, np.ndarray] | None = None,
) -> Any:
    """A session running `node` alone on inputs typed like `feeds` (names → arrays); the
    `constants` among them are initializers (ONNX Runtime's checks need some of them, e.g.
    Resize's empty `scales` next to `sizes`), the rest are the session's inputs."""
    constants = constants or {}
    inputs = [
        helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)
        )
        for name, value in feeds.items()
        if name not in constants
    ]
    initializers = [numpy_helper.from_array(np.asarray(v), name) for name, v in constants.items()]
    outputs = [helper.make_empty_tensor_value_info(name) for name in node.output if name]
    graph = helper.make_graph(
        [node], f"float_{node.name or node.output[0]}", inputs, outputs, initializers
    )
    imports = [helper.make_opsetid(domain, version) for domain, version in opsets.items()]
    model = shape_inference.infer_shapes(helper.make_model(graph, opset_imports=imports))
    return host_session(model.SerializeToString())
