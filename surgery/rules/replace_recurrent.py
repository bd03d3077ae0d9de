"""recurrent-to-cells: LSTM, GRU and RNN nodes unrolled into the MatMuls and gates of each step.

A recurrent node is one op to ONNX but a loop to an accelerator: no NPU table places it, so a
CRNN text recogniser, a GRU voice-activity detector or a BiLSTM tagger runs its recurrence on
the CPU between two MLA segments. With a static number of steps the loop is a fixed chain of
MatMuls, Sigmoids, Tanhs, Muls and Adds, every one of which the MLA runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from pydantic import Field

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    add_slice,
    model_opset,
    net_freed,
    probe_node,
    probe_slice,
    reshape_source,
)

MAX_CELLS = 512
"""Steps × directions unrolled per node by default: each cell is some ten nodes, so a longer
recurrence would swamp the graph (and `surgery check`) with thousands of them."""

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {
    "LSTM": ["Sigmoid", "Tanh", "Tanh"],
    "GRU": ["Sigmoid", "Tanh"],
    "RNN": ["Tanh"],
}


class RecurrentParams(RuleParams):
    max_cells: int = Field(
        MAX_CELLS,
        gt=0,
        description="Unroll only nodes of at most this many steps × directions.",
    )


@dataclass(frozen=True)
class Recurrence:
    """What `find` read of one recurrent node."""

    kind: str
    steps: int
    batch: int
    hidden: int
    directions: int
    reverse_only: bool
    linear_before_reset: bool
    initial: tuple[bool, ...]
    """Whether initial_h (and, for LSTM, initial_c) is given and not all zeros."""

    axis = 1
    """The axis of steps (and of directions in the states) in the 4-D view [1, T, B, ·] the
    cells work on."""

    def step_shape(self, width: int) -> list[int]:
        return [1, 1, self.batch, width]


def _read(pat: Pattern, idx: int, max_cells: int) -> tuple[Recurrence, str] | None:
    """The recurrence of node `idx` when it can be unrolled, with a one-line description."""
    kind = pat.op(idx)
    ins = list(pat.ins(idx)) + [""] * 8
    attrs = pat.attrs(idx)
    x = ins[0]
    shape = pat.shape(x)
    if shape is None or len(shape) != 3 or not pat.is_float(x) or pat.is_const(x):
        return None
    direction = attrs.get("direction", "forward")
    if isinstance(direction, bytes):
        direction = direction.decode()
    directions = 2 if direction == "bidirectional" else 1
    activations = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations", [])]
    if activations and activations != _DEFAULT_ACTIVATIONS[kind] * directions:
        return None
    if "clip" in attrs or attrs.get("input_forget", 0) or "activation_alpha" in attrs:
        return None
    if attrs.get("layout", 0):
        return None  # batch-first: ONNX Runtime runs none, so no rewrite could be verified
    steps, batch = shape[0], shape[1]
    hidden = int(attrs.get("hidden_size", 0))
    gates = _GATES[kind]
    weights = [pat.stored(t) if t else None for t in ins[1:4]]
    w, r = weights[0], weights[1]
    if w is None or r is None or (ins[3] and weights[2] is None) or not hidden:
        return None
    if w.shape != (directions, gates * hidden, shape[2]) or r.shape != (
        directions,
        gates * hidden,
        hidden,
    ):
        return None
    if steps * directions > max_cells:
        return None
    if ins[4]:
        lengths = pat.stored(ins[4])
        if lengths is None or np.any(lengths != steps):
            return None
    if kind == "LSTM" and ins[7] and not _zero(pat, ins[7]):
        return None  # peepholes: no exporter writes them
    initial = tuple(
        bool(t) and not _zero(pat, t) for t in (ins[5], ins[6] if kind == "LSTM" else "")
    )
    recurrence = Recurrence(
        kind,
        steps,
        batch,
        hidden,
        directions,
        direction == "reverse",
        bool(attrs.get("linear_before_reset", 0)),
        initial if kind == "LSTM" else initial[:1],
    )
    return recurrence, f"{direction} {kind} of {steps} steps, hidden {hidden}"


def _zero(pat: Pattern, tensor: str) -> bool:
    value = pat.stored(tensor)
    return value is not None and not np.any(value)


def _probes(ctx: RuleContext, rec: Recurrence, input_size: int) -> list:
    """Placement of one cell's kinds of node on the MLA."""
    h = rec.hidden
    state = TensorSpec(tuple(rec.step_shape(h)))
    gates = TensorSpec(tuple(rec.step_shape(_GATES[rec.kind] * h)))
    inputs = TensorSpec(tuple(rec.step_shape(input_size)))
    recurrent = TensorSpec.const(np.zeros((h, _GATES[rec.kind] * h), np.float32))
    x_weight = TensorSpec.const(np.zeros((input_size, _GATES[rec.kind] * h), np.float32))
    probes = [
        probe_node(ctx, "MatMul", [inputs, x_weight], [gates]),
        probe_node(ctx, "MatMul", [state, recurrent], [gates]),
        probe_node(ctx, "Add", [gates, gates], [gates]),
        probe_node(ctx, "Tanh", [state], [state]),
        probe_node(ctx, "Mul", [state, state], [state]),
        probe_node(ctx, "Concat", [state, state], [_wider(rec, state)], {"axis": rec.axis}),
    ]
    if rec.kind != "RNN":
        probes.append(probe_node(ctx, "Sigmoid", [state], [state]))
        probes.append(probe_slice(ctx, gates, state, [0], [h], [3]))
    return probes


def _wider(rec: Recurrence, state: TensorSpec) -> TensorSpec:
    shape = list(state.shape or ())
    shape[rec.axis] = 2
    return TensorSpec(tuple(shape))


@register
class RecurrentToCells(GraphRule):
    """Unroll an LSTM, GRU or RNN node with a static number of steps (CRNN text recognisers,
    GRU voice-activity detectors, BiLSTM sequence taggers) into one step cell per time step.

    The input projection of every step is one MatMul by W (biases folded in) on the 4-D view
    [1, T, B, I], Split into the steps. Each cell adds
    its state's MatMul by R and applies the gates (LSTM: i, o, f, c with Sigmoid and Tanh; GRU:
    z, r, h with either linear_before_reset; RNN: Tanh); the steps' states are concatenated
    into Y and the last ones into Y_h / Y_c. Reverse and bidirectional nodes run their cells
    backwards. An absent or all-zero initial state drops the first cell's recurrent terms.

    Left alone: batch-first `layout` 1 (which ONNX Runtime does not run), dynamic lengths, per-batch `sequence_lens` shorter than the input,
    peepholes, `clip`, `input_forget`, non-default activations, and nodes of more than
    `max_cells` steps × directions (default 512). The same function to float rounding.
    """

    name = "recurrent-to-cells"
    suggest_for = frozenset(_GATES)
    summary = "LSTM / GRU / RNN of static length → per-step MatMuls and gates the MLA runs."
    category = "replace"
    Params = RecurrentParams
    example = "surgery apply recurrent-to-cells crnn.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        assert isinstance(params, RecurrentParams)
        pat = Pattern(ctx)
        found = []
        for idx in pat.blocked(*_GATES):
            read = _read(pat, idx, params.max_cells)
            if read is None:
                continue
            rec, description = read
            x = pat.ins(idx)[0]
            input_size = (pat.shape(x) or (0, 0, 0))[2]
            source, absorbed = reshape_source(pat, x)
            name = pat.name(idx)
            found.append(
                self.match(
                    [name, *absorbed],
                    f"{description} {name} → {rec.steps * rec.directions} unrolled cells",
                    net_freed(ctx, [name, *absorbed], _probes(ctx, rec, input_size)),
                    recurrence=rec,
                    source=source,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        rec: Recurrence = match.data["recurrence"]
        inputs = list(node.inputs) + [None] * (8 - len(node.inputs))
        outputs = list(node.outputs) + [None] * (3 - len(node.outputs))
        w, r = ed.value(inputs[1]), ed.value(inputs[2])
        if w is None or r is None:
            return False
        gates = _GATES[rec.kind] * rec.hidden
        bias = ed.value(inputs[3]) if _given(inputs[3]) else None
        if bias is None:
            bias = np.zeros((rec.directions, 2 * gates), np.float32)
        x = inputs[0]
        ed.detach(node)
        cells = _Cells(ed, rec, x.dtype)
        source = ed.tensor(match.data["source"])  # x itself, or what a Reshape made x from
        x4 = cells.reshape(source, [1, rec.steps, rec.batch, w.shape[2]], "rnn_input_4d")
        states = [
            cells.initial(inputs[5 + k], k) if given else None
            for k, given in enumerate(rec.initial)
        ]
        sequences, last = [], []
        for d in range(rec.directions):
            reverse = rec.reverse_only or d == 1
            projected = cells.project(x4, w[d], bias[d])
            steps = cells.split_steps(projected)
            state = [s[d] if s is not None else None for s in states]
            ys: list[gs.Tensor] = [None] * rec.steps  # type: ignore[list-item]
            for t in reversed(range(rec.steps)) if reverse else range(rec.steps):
                state = cells.step(steps[t], state, r[d], bias[d])
                ys[t] = state[0]
            sequences.append(ys)
            last.append(state)
        cells.write_outputs(outputs, sequences, last)
        return True


def _given(tensor: gs.Tensor | None) -> bool:
    return tensor is not None and bool(tensor.name)


def _used(tensor: gs.Tensor | None, graph: gs.Graph) -> bool:
    return _given(tensor) and (bool(tensor.outputs) or tensor in graph.outputs)


def _split(ed: Editor, x: gs.Tensor, outs: list[gs.Variable], axis: int, base: str) -> None:
    """An equal Split of x into outs (opset 18 wants their number as an attribute)."""
    attrs = {"num_outputs": len(outs)} if model_opset(ed.ctx) >= 18 else {}
    ed.node("Split", base, [x], outs, axis=axis, **attrs)


class _Cells:
    """Builds one recurrent node's cells with an Editor (shapes as `Recurrence.step_shape`)."""

    def __init__(self, ed: Editor, rec: Recurrence, dtype) -> None:
        self.ed, self.rec, self.dtype = ed, rec, dtype
        self.h = rec.hidden

    def op(self, op: str, inputs, width: int, **attrs) -> gs.Variable:
        shape = self.rec.step_shape(width)
        return self.ed.op(
            op, f"{self.rec.kind.lower()}_{op.lower()}", inputs, shape, self.dtype, **attrs
        )

    def const(self, value: np.ndarray) -> gs.Constant:
        return self.ed.const(f"{self.rec.kind.lower()}_weight", value.astype(np.float32))

    def reshape(self, x: gs.Tensor, shape: list[int], base: str, out: gs.Tensor | None = None):
        target = self.ed.const(f"{base}_shape", np.array(shape, np.int64))
        if out is not None:
            self.ed.node("Reshape", base, [x, target], [out])
            return out
        return self.ed.op("Reshape", base, [x, target], shape, self.dtype)

    def slice(self, x: gs.Tensor, start: int, stop: int) -> gs.Variable:
        out = self.ed.var(
            f"{self.rec.kind.lower()}_gate", self.dtype, self.rec.step_shape(stop - start)
        )
        add_slice(self.ed, x, out, [start], [stop], [3])
        return out

    def split(self, x: gs.Tensor, parts: int, width: int) -> list[gs.Variable]:
        """x split into `parts` equal gates of `width` along the last axis."""
        outs = [
            self.ed.var(f"{self.rec.kind.lower()}_gate", self.dtype, self.rec.step_shape(width))
            for _ in range(parts)
        ]
        _split(self.ed, x, outs, 3, f"{self.rec.kind.lower()}_gates")
        return outs

    def initial(self, state: gs.Tensor, k: int) -> list[gs.Tensor]:
        """The per-direction views [1, 1, B, H] of an initial state [dirs, B, H]."""
        rec = self.rec
        whole = self.reshape(state, [1, *state.shape], f"rnn_initial_{k}")
        if rec.directions == 1:
            return [whole]
        outs = [self.ed.var("rnn_initial", self.dtype, rec.step_shape(self.h)) for _ in range(2)]
        _split(self.ed, whole, outs, rec.axis, "rnn_initial_split")
        return outs

    def project(self, x4: gs.Tensor, w: np.ndarray, bias: np.ndarray) -> gs.Variable:
        """x · Wᵀ plus every bias that does not multiply with a gate: [1, T, B, G]."""
        rec, h = self.rec, self.h
        gates = _GATES[rec.kind] * h
        folded = bias[:gates] + bias[gates:]
        if rec.kind == "GRU" and rec.linear_before_reset:
            folded[2 * h :] = bias[2 * h : gates]  # R's candidate bias is multiplied by r
        shape = [*x4.shape[:3], gates]
        product = self.ed.op(
            "MatMul", "rnn_input_projection", [x4, self.const(w.T)], shape, self.dtype
        )
        if not np.any(folded):
            return product
        return self.ed.op("Add", "rnn_input_bias", [product, self.const(folded)], shape, self.dtype)

    def split_steps(self, projected: gs.Tensor) -> list[gs.Variable]:
        rec = self.rec
        if rec.steps == 1:
            return [projected]
        width = _GATES[rec.kind] * self.h
        outs = [
            self.ed.var("rnn_step_input", self.dtype, rec.step_shape(width))
            for _ in range(rec.steps)
        ]
        _split(self.ed, projected, outs, rec.axis, "rnn_steps")
        return outs

    def step(self, x: gs.Tensor, state: list, r: np.ndarray, bias: np.ndarray) -> list:
        kind = self.rec.kind
        if kind == "LSTM":
            return self._lstm(x, state, r)
        if kind == "GRU":
            return self._gru(x, state, r, bias)
        h = state[0]
        pre = (
            x
            if h is None
            else self.op("Add", [x, self.op("MatMul", [h, self.const(r.T)], self.h)], self.h)
        )
        return [self.op("Tanh", [pre], self.h)]

    def _lstm(self, x: gs.Tensor, state: list, r: np.ndarray) -> list:
        h, c = state
        width = 4 * self.h
        if h is not None:
            x = self.op("Add", [x, self.op("MatMul", [h, self.const(r.T)], width)], width)
        sigmoid = self.op("Sigmoid", [self.slice(x, 0, 3 * self.h)], 3 * self.h)
        i, o, f = self.split(sigmoid, 3, self.h)
        candidate = self.op("Tanh", [self.slice(x, 3 * self.h, width)], self.h)
        c_new = self.op("Mul", [i, candidate], self.h)
        if c is not None:
            c_new = self.op("Add", [self.op("Mul", [f, c], self.h), c_new], self.h)
        h_new = self.op("Mul", [o, self.op("Tanh", [c_new], self.h)], self.h)
        return [h_new, c_new]

    def _gru(self, x: gs.Tensor, state: list, r: np.ndarray, bias: np.ndarray) -> list:
        h_prev = state[0]
        hh = self.h
        candidate_bias = bias[5 * hh :]  # R's bias of the candidate
        x_gates, x_candidate = self.slice(x, 0, 2 * hh), self.slice(x, 2 * hh, 3 * hh)
        if h_prev is None:
            z, reset = self.split(self.op("Sigmoid", [x_gates], 2 * hh), 2, hh)
            if self.rec.linear_before_reset and np.any(candidate_bias):
                term = self.op("Mul", [reset, self.const(candidate_bias)], hh)
                x_candidate = self.op("Add", [x_candidate, term], hh)
            candidate = self.op("Tanh", [x_candidate], hh)
            return [self.op("Sub", [candidate, self.op("Mul", [z, candidate], hh)], hh)]
        if self.rec.linear_before_reset:
            recurrent = self.op("MatMul", [h_prev, self.const(r.T)], 3 * hh)
            if np.any(candidate_bias):
                padded = np.concatenate([np.zeros(2 * hh, np.float32), candidate_bias])
                recurrent = self.op("Add", [recurrent, self.const(padded)], 3 * hh)
            gates = self.op("Add", [x_gates, self.slice(recurrent, 0, 2 * hh)], 2 * hh)
            z, reset = self.split(self.op("Sigmoid", [gates], 2 * hh), 2, hh)
            term = self.op("Mul", [reset, self.slice(recurrent, 2 * hh, 3 * hh)], hh)
        else:
            product = self.op("MatMul", [h_prev, self.const(r[: 2 * hh].T)], 2 * hh)
            gates = self.op("Add", [x_gates, product], 2 * hh)
            z, reset = self.split(self.op("Sigmoid", [gates], 2 * hh), 2, hh)
            reset_state = self.op("Mul", [reset, h_prev], hh)
            term = self.op("MatMul", [reset_state, self.const(r[2 * hh :].T)], hh)
        candidate = self.op("Tanh", [self.op("Add", [x_candidate, term], hh)], hh)
        change = self.op("Mul", [z, self.op("Sub", [h_prev, candidate], hh)], hh)
        return [self.op("Add", [candidate, change], hh)]

    def write_outputs(self, outputs: list, sequences: list[list], last: list[list]) -> None:
        """Y = the steps' h along the step axis, directions along the next; Y_h, Y_c = the last
        states along the direction axis — each written into the node's own output tensor."""
        rec, graph = self.rec, self.ed.graph
        if _used(outputs[0], graph):
            joined = [self.concat(ys, rec.steps, "rnn_sequence") for ys in sequences]
            one = [rec.steps, 1, rec.batch, self.h]
            if rec.directions == 1:
                self.reshape(joined[0], one, "rnn_output", outputs[0])
            else:
                parts = [self.reshape(p, one, "rnn_output_direction") for p in joined]
                self.ed.node("Concat", "rnn_output", parts, [outputs[0]], axis=rec.axis)
        for k, out in enumerate(outputs[1:3]):
            if not _used(out, graph) or k >= len(last[0]):
                continue
            joined = self.concat([s[k] for s in last], rec.directions, "rnn_last_state")
            self.reshape(joined, [rec.directions, rec.batch, self.h], "rnn_last", out)

    def concat(self, parts: list[gs.Tensor], count: int, base: str) -> gs.Tensor:
        """The parts (step-shaped) joined along the step axis."""
        if len(parts) == 1:
            return parts[0]
        return self.ed.op("Concat", base, parts, self._along(count), self.dtype, axis=self.rec.axis)

    def _along(self, count: int) -> list[int]:
        shape = self.rec.step_shape(self.h)
        shape[self.rec.axis] = count
        return shape
