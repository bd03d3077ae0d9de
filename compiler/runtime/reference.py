"""The integer reference executor: the bit-exact specification of a quantized model.

`IntegerExecutor` reads a standard QDQ ONNX model (QuantizeLinear / DequantizeLinear around
float ops), turns it into an integer program (`compiler.runtime.lowering`) and runs it with the
integer arithmetic of `compiler.intmath`. The MLA emulator must reproduce `run_integer` bit for
bit. docs/integer-semantics.md describes every rule.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from compiler.intmath import REQUANTIZATION_MODES, RequantizationMode, dtype_range
from compiler.runtime.errors import ExecutionError
from compiler.runtime.lowering import QdqGraph, build_program
from compiler.runtime.program import DequantizeStep, QuantizeStep, Step
from compiler.runtime.qparams import QuantParams


class IntegerExecutor:
    """Run a QDQ model in integers.

    `run` takes and returns float arrays (graph inputs are quantized by their QuantizeLinear,
    outputs dequantized by their DequantizeLinear); `run_integer` takes and returns the integer
    tensors on the other side of those nodes, for bit-exact comparisons. With
    `keep_intermediates=True` every tensor of the last run stays in `intermediates`, keyed by
    its name in the QDQ model (integer tensors are the QuantizeLinear outputs; `tensor_params`
    gives their quantization). Nodes the integer program cannot express run in float and are
    listed in `float_nodes` with the reason; `strict=True` makes that an error for nodes that
    sit between DequantizeLinear and QuantizeLinear.
    """

    def __init__(
        self,
        qdq_model: onnx.ModelProto,
        requantization_mode: RequantizationMode = "sima",
        *,
        keep_intermediates: bool = False,
        strict: bool = False,
    ) -> None:
        if requantization_mode not in REQUANTIZATION_MODES:
            raise ValueError(
                f"requantization_mode must be one of {REQUANTIZATION_MODES}, "
                f"not {requantization_mode!r}"
            )
        self.requantization_mode: RequantizationMode = requantization_mode
        self.keep_intermediates = keep_intermediates
        self._graph = QdqGraph(qdq_model)
        program = build_program(self._graph, requantization_mode, strict=strict)
        self.steps: tuple[Step, ...] = program.steps
        self.float_nodes: tuple[tuple[str, str], ...] = program.float_nodes
        self.tensor_params: dict[str, QuantParams] = program.tensor_params
        self.input_names: list[str] = self._graph.input_names
        self.output_names: list[str] = self._graph.output_names
        self.intermediates: dict[str, np.ndarray] = {}
        self.runs = 0
        """Runs so far: the first makes the ONNX Runtime sessions of its float steps (tens of
        ms each), which a stage's measured run time leaves out (`pipeline._run_reference`)."""
        self._input_quantizers = self._find_input_quantizers()
        self._output_dequantizers = {
            step.output: step
            for step in self.steps
            if isinstance(step, DequantizeStep) and step.output in self.output_names
        }

    @property
    def input_params(self) -> dict[str, QuantParams]:
        """Quantization of each graph input that a single QuantizeLinear quantizes."""
        return {name: step.params for name, step in self._input_quantizers.items()}

    @property
    def output_params(self) -> dict[str, QuantParams]:
        """Quantization of each graph output produced by a DequantizeLinear."""
        return {name: step.params for name, step in self._output_dequantizers.items()}

    def _find_input_quantizers(self) -> dict[str, QuantizeStep]:
        quantizers: dict[str, QuantizeStep] = {}
        for name in self.input_names:
            readers = self._graph.consumers.get(name, [])
            steps = [s for s in self.steps if isinstance(s, QuantizeStep) and s.input == name]
            if len(steps) == 1 and len(readers) == 1:
                quantizers[name] = steps[0]
        return quantizers

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Float in, float out: quantize the inputs, run the integer program, dequantize."""
        values = self._initial_values()
        for name in self.input_names:
            if name not in inputs:
                raise ExecutionError(f"missing input {name!r}; the model needs {self.input_names}")
            dtype = self._graph.input_types.get(name)
            values[name] = np.asarray(inputs[name], dtype=dtype)
        self._execute(values, skip=())
        self.runs += 1
        return {name: values[name] for name in self.output_names}

    def run_integer(self, int_inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Integer in, integer out: the inputs replace the graph inputs' QuantizeLinear outputs.

        Each key is a graph input name; its array holds the codes that input's QuantizeLinear
        would produce (the dtype of `input_params[name]`). Graph inputs without a QuantizeLinear
        take their value as given. Outputs produced by a DequantizeLinear are returned as that
        node's integer input; other outputs (float islands) as they are.
        """
        values = self._initial_values()
        skip: list[Step] = []
        for name in self.input_names:
            if name not in int_inputs:
                raise ExecutionError(f"missing input {name!r}; the model needs {self.input_names}")
            quantizer = self._input_quantizers.get(name)
            if quantizer is None:
                values[name] = np.asarray(int_inputs[name])
                continue
            values[quantizer.output] = _as_codes(int_inputs[name], quantizer.params, name)
            skip.append(quantizer)
        self._execute(values, skip=skip)
        results = {}
        for name in self.output_names:
            dequantizer = self._output_dequantizers.get(name)
            results[name] = values[dequantizer.input] if dequantizer else values[name]
        return results

    def _initial_values(self) -> dict[str, np.ndarray]:
        return dict(self._graph.constants)

    def _execute(self, values: dict[str, np.ndarray], skip: tuple[Step, ...] | list[Step]) -> None:
        skipped = {id(step) for step in skip}
        for step in self.steps:
            if id(step) not in skipped:
                step.run(values)
        if self.keep_intermediates:
            constants = self._graph.constants
            self.intermediates = {k: v for k, v in values.items() if k not in constants}

    def summary(self) -> list[dict[str, str]]:
        """One row per step: kind (integer/quantize/dequantize/float), name and pattern."""
        return [{"kind": s.kind, "name": s.name, "pattern": s.pattern} for s in self.steps]


def _as_codes(array: np.ndarray, params: QuantParams, name: str) -> np.ndarray:
    """Integer input codes, checked against the range of the input's storage type."""
    array = np.asarray(array)
    if not np.issubdtype(array.dtype, np.integer):
        raise ExecutionError(f"run_integer needs integer codes for {name!r}, got {array.dtype}")
    low, high = dtype_range(params.dtype)
    if array.size and (array.min() < low or array.max() > high):
        raise ExecutionError(f"codes of {name!r} fall outside {np.dtype(params.dtype).name}")
    return array.astype(params.dtype)
