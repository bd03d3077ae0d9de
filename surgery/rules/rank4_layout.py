"""Layouts: how a tensor of any rank is carried as a 4-D tensor, and how to move between layouts.

A `Layout` assigns every axis of the original tensor to one of the four axes ("slots") of the
4-D tensor. A slot may hold no axis (size 1), one axis, or several consecutive ones (merged, as a
reshape merges them). The 4-D tensor is `transpose(x, layout.order).reshape(layout.shape4(shape))`,
so a layout is exactly "an optional transpose, then a reshape" and every conversion between two
layouts of the same tensor is at most Reshape → Transpose → Reshape, all on 4-D tensors.

Axes of size 1 carry no data: two layouts that list the non-unit axes in the same order differ by
a Reshape only. Conversions that must permute go through a "spread" 4-D tensor with a leading
unit axis, so the Transpose never moves axis 0 (the MLA keeps the batch axis in place) whenever
the tensor has at most three non-unit axes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

Shape = tuple[int, ...]
Groups = tuple[tuple[int, ...], ...]
Step = tuple[str, tuple[int, ...]]
"""("Reshape", target shape) or ("Transpose", perm)."""

SLOTS = 4


@dataclass(frozen=True)
class Layout:
    """Original axes per 4-D slot; the concatenation of the groups is the transpose order."""

    groups: Groups

    def __post_init__(self) -> None:
        if len(self.groups) != SLOTS:
            raise ValueError(f"a layout has {SLOTS} slots, got {len(self.groups)}")

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(a for g in self.groups for a in g)

    @property
    def rank(self) -> int:
        return len(self.order)

    def shape4(self, shape: Sequence[int]) -> Shape:
        return tuple(prod(shape[a] for a in g) for g in self.groups)

    def slot(self, axis: int) -> int:
        return next(k for k, g in enumerate(self.groups) if axis in g)

    def alone(self, axis: int, shape: Sequence[int]) -> int | None:
        """The slot holding `axis`, if every other axis in that slot has size 1."""
        k = self.slot(axis)
        return k if all(shape[a] == 1 for a in self.groups[k] if a != axis) else None

    def broadcasts(self, shape: Sequence[int], full: Sequence[int]) -> bool:
        """Whether an operand of `shape` (same rank as `full`, each dim equal or 1) still
        broadcasts against the `full` tensor in this layout: in every slot its axes either all
        match `full` or all have size 1, so 4-D broadcasting pairs the same elements."""
        return all(
            all(shape[a] == full[a] for a in g) or prod(shape[a] for a in g) == 1
            for g in self.groups
        )

    def nonunit_order(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(a for a in self.order if shape[a] != 1)

    def is_plain(self, shape: Sequence[int]) -> bool:
        """True when the 4-D tensor is a plain reshape of the original (no data movement)."""
        order = self.nonunit_order(shape)
        return list(order) == sorted(order)

    def leading(self, shape: Sequence[int]) -> set[int]:
        """Non-unit axes held in slot 0."""
        return {a for a in self.groups[0] if shape[a] != 1}

    def permuted(self, perm: Sequence[int]) -> Layout:
        """The layout of `Transpose(x, perm)` that holds the very same 4-D data."""
        inverse = {a: i for i, a in enumerate(perm)}
        return Layout(tuple(tuple(inverse[a] for a in g) for g in self.groups))

    def without(self, axis: int) -> Layout:
        """Drop an axis of size 1 (its slot keeps its other axes) and renumber the rest."""
        return Layout(tuple(tuple(a - (a > axis) for a in g if a != axis) for g in self.groups))

    def __repr__(self) -> str:
        return "Layout(" + "|".join(",".join(map(str, g)) or "-" for g in self.groups) + ")"


def make(*groups: Sequence[int]) -> Layout:
    padded = [tuple(g) for g in groups] + [()] * (SLOTS - len(groups))
    return Layout(tuple(padded))


def identity(rank: int = SLOTS) -> Layout:
    return make(*[(a,) for a in range(rank)])


def ncl(rank: int) -> Layout:
    """Channels stay on axis 1 and the last axis goes to the width: [N,C,L] → [N,C,1,L]."""
    if rank == SLOTS:
        return identity()
    if rank == 3:
        return make((0,), (1,), (), (2,))
    if rank == 2:
        return make((0,), (1,))
    if rank == 1:
        return make((), (0,))
    raise ValueError(f"no NCL layout for rank {rank}")


def rows(rank: int, axis: int | None = None) -> Layout:
    """Everything before `axis` merged into slot 0, `axis` alone in slot 1, the rest in slot 2.

    For [B,L,C] and the last axis this is [B·L, C, 1, 1]: one row per token, the feature on the
    channel axis — the form in which a 1×1 Conv, LayerNormalization(axis=1) and Softmax(axis=1)
    compute exactly what the rank-3 op computed.
    """
    axis = rank - 1 if axis is None else axis
    return make(tuple(range(axis)), (axis,), tuple(range(axis + 1, rank)))


def coerced(rank: int, axis: int) -> Layout:
    """Axes before `axis` in slot 0, the rest merged in slot 1 (opset < 13 Softmax semantics)."""
    return make(tuple(range(axis)), tuple(range(axis, rank)))


def normalized(rank: int, axis: int) -> Layout:
    """Axes before `axis` in slot 0, axes from `axis` on spread over slots 1..3 in order."""
    tail = list(range(axis, rank))
    if len(tail) <= 3:
        return make(tuple(range(axis)), *[(a,) for a in tail])
    return make(tuple(range(axis)), (tail[0],), (tail[1],), tuple(tail[2:]))


def matmul(rank: int) -> Layout:
    """Batch axes in slots 0–1, the two matrix axes alone in slots 2 and 3. Above rank 4 the
    leading batch axes share slot 0 (both operands of a product have the same batch axes, so
    they merge the same way)."""
    if rank < 2:
        raise ValueError(f"no MatMul layout for rank {rank}")
    if rank > SLOTS:
        return make(tuple(range(rank - 3)), (rank - 3,), (rank - 2,), (rank - 1,))
    batch = [(a,) for a in range(rank - 2)]
    lead = [()] * (2 - len(batch))
    return make(*lead, *batch, (rank - 2,), (rank - 1,))


def spread(shape: Sequence[int]) -> Layout | None:
    """Plain layout with every non-unit axis alone, right-aligned; None if more than 4 non-unit.

    Unit axes join the slot of the next non-unit axis (the last slot when trailing).
    """
    nonunit = [a for a, d in enumerate(shape) if d != 1]
    if len(nonunit) > SLOTS:
        return None
    first = SLOTS - len(nonunit)
    slot_of = {a: first + k for k, a in enumerate(nonunit)}
    groups: list[list[int]] = [[] for _ in range(SLOTS)]
    pending: list[int] = []
    for a in range(len(shape)):
        if a in slot_of:
            groups[slot_of[a]].extend([*pending, a])
            pending = []
        else:
            pending.append(a)
    groups[SLOTS - 1].extend(pending)
    return Layout(tuple(tuple(g) for g in groups))


def broadcast_blocks(out: Sequence[int], operands: Sequence[Sequence[int]]) -> Layout | None:
    """A plain layout for an elementwise result with more than four non-unit axes: runs of
    consecutive axes that every operand either has in full or broadcasts (size 1) alike share
    a slot, so each operand still broadcasts in 4-D. SAM's decomposed relative position adds
    rel_h [B·h, qh, qw, kh, 1] and rel_w [B·h, qh, qw, 1, kw]: (qh, qw) is one run. None when
    the runs are more than four."""

    if any(len(s) != len(out) for s in operands):
        return None

    def pattern(axis: int) -> tuple[bool, ...]:
        return tuple(s[axis] == out[axis] for s in operands)

    groups: list[list[int]] = []
    for axis, size in enumerate(out):
        if groups and (size == 1 or pattern(axis) == pattern(groups[-1][-1])):
            groups[-1].append(axis)
        else:
            groups.append([axis])
    if len(groups) > SLOTS:
        return None
    padded = [()] * (SLOTS - len(groups)) + [tuple(g) for g in groups]
    return Layout(tuple(padded))


def reducing(shape: Sequence[int], axes: Sequence[int]) -> Layout | None:
    """Kept axes on slots 0–1 and reduced axes on the spatial slots 2–3: the form in which a
    Reduce* is a spatial reduction (a mean over tokens becomes a global average pool).

    None when more than two non-unit axes are kept. Unit axes join slot 0; three or more
    reduced axes share slot 3 (they are all reduced, so merging them changes nothing).
    """
    kept = [a for a, d in enumerate(shape) if d != 1 and a not in axes]
    reduced = [a for a, d in enumerate(shape) if d != 1 and a in axes]
    if len(kept) > 2:
        return None
    units = [a for a, d in enumerate(shape) if d == 1]
    groups: list[list[int]] = [list(units), [], [], []]
    for k, a in enumerate(kept[::-1]):
        groups[1 - k].append(a)
    if reduced:
        groups[2].append(reduced[0])
        groups[3].extend(reduced[1:])
    return Layout(tuple(tuple(g) for g in groups))


def relabel_reshape(layout: Layout, src: Sequence[int], dst: Sequence[int]) -> Layout | None:
    """Layout of `Reshape(x, dst)` when the reshape only adds or removes axes of size 1.

    Returns None when the reshape merges or splits non-unit axes (a real reshape).
    """
    src_nonunit = [a for a, d in enumerate(src) if d != 1]
    dst_nonunit = [a for a, d in enumerate(dst) if d != 1]
    if [src[a] for a in src_nonunit] != [dst[a] for a in dst_nonunit]:
        return None
    to_dst = dict(zip(src_nonunit, dst_nonunit, strict=True))
    groups = [[to_dst[a] for a in g if a in to_dst] for g in layout.groups]
    slot_of = {b: k for k, g in enumerate(groups) for b in g}
    current = 0  # unit axes join slot 0 until the first non-unit axis, then its slot
    for b in range(len(dst)):
        if b in slot_of:
            current = slot_of[b]
        else:
            groups[current].append(b)
    return Layout(tuple(tuple(g) for g in groups))


def steps_between(shape: Sequence[int], src: Layout | None, dst: Layout | None) -> list[Step]:
    """Reshape/Transpose steps that turn the `src` form of a tensor into its `dst` form.

    `None` stands for the original tensor (rank len(shape)). Every intermediate is 4-D and, with
    at most three non-unit axes, every Transpose keeps axis 0 in place.
    """
    shape = tuple(shape)
    plain = tuple(a for a, d in enumerate(shape) if d != 1)
    src_shape = shape if src is None else src.shape4(shape)
    dst_shape = shape if dst is None else dst.shape4(shape)
    a = plain if src is None else src.nonunit_order(shape)
    b = plain if dst is None else dst.nonunit_order(shape)
    if a == b:
        return [] if src_shape == dst_shape else [("Reshape", dst_shape)]
    if src is not None:
        moved = _slot_permutation(src, shape, b)
        if moved is not None and (moved[0] == 0 or len(a) > SLOTS - 1):
            steps: list[Step] = [("Transpose", moved)]
            if tuple(src_shape[p] for p in moved) != dst_shape:
                steps.append(("Reshape", dst_shape))
            return steps
    k = len(a)
    if k > SLOTS:
        raise ValueError(f"cannot carry {k} non-unit axes in 4-D")
    lead = 1 if k < SLOTS else 0
    dims = tuple(shape[x] for x in a)
    spread_shape = (1,) * lead + dims + (1,) * (SLOTS - lead - k)
    perm = tuple(range(lead)) + tuple(a.index(x) + lead for x in b) + tuple(range(lead + k, SLOTS))
    steps = []
    if src_shape != spread_shape:
        steps.append(("Reshape", spread_shape))
    steps.append(("Transpose", perm))
    moved = tuple(spread_shape[p] for p in perm)
    if moved != dst_shape:
        steps.append(("Reshape", dst_shape))
    return steps


def _slot_permutation(
    layout: Layout, shape: Sequence[int], order: tuple[int, ...]
) -> tuple[int, ...] | None:
    """A 4-D perm that moves whole slots so their non-unit axes read in `order`, if one exists.

    Slots without data stay put where possible (slot 0 first), so a slot-level move keeps the
    batch axis in place whenever the data does not live there.
    """
    blocks = {k: tuple(a for a in g if shape[a] != 1) for k, g in enumerate(layout.groups)}
    filled = [k for k, block in blocks.items() if block]
    sequence: list[int] = []
    rest = list(order)
    while rest:
        k = next((k for k in filled if rest[: len(blocks[k])] == list(blocks[k])), None)
        if k is None or k in sequence:
            return None
        sequence.append(k)
        rest = rest[len(blocks[k]) :]
    empty = [k for k in range(SLOTS) if k not in sequence]
    lead = [0] if 0 in empty else []
    return tuple(lead + sequence + [k for k in empty if k not in lead])


def moving_runs(shape: Sequence[int], perm: Sequence[int]) -> list[list[int]]:
    """The non-unit axes of `shape` grouped into the runs Transpose(perm) moves as blocks
    (consecutive in the input and kept consecutive by the permutation), in output order."""
    nonunit = [a for a, d in enumerate(shape) if d != 1]
    following = dict(itertools.pairwise(nonunit))
    runs: list[list[int]] = []
    for a in (p for p in perm if shape[p] != 1):
        if runs and following.get(runs[-1][-1]) == a:
            runs[-1].append(a)
        else:
            runs.append([a])
    return runs


def transpose_runs(shape: Sequence[int], perm: Sequence[int]) -> Layout | None:
    """Plain layout of a Transpose input that keeps together the axes the Transpose keeps together.

    A window partition [1,nH,h,nW,w,C] → perm (0,1,3,2,4,5) has five non-unit axes but only
    four runs (nH)(h)(nW)(w,C) that move as blocks, so it is a 4-D Transpose of slots. None when
    the permutation breaks the tensor into more than four runs.
    """
    runs = moving_runs(shape, perm)
    if len(runs) > SLOTS:
        return None
    runs.sort()
    first = SLOTS - len(runs)
    slot_of = {a: first + k for k, run in enumerate(runs) for a in run}
    groups: list[list[int]] = [[] for _ in range(SLOTS)]
    pending: list[int] = []
    for a in range(len(shape)):
        if a in slot_of:
            groups[slot_of[a]].extend([*pending, a])
            pending = []
        else:
            pending.append(a)
    groups[SLOTS - 1].extend(pending)
    return Layout(tuple(tuple(g) for g in groups))


def moves_batch_slot(layout: Layout, shape: Sequence[int], perm: Sequence[int]) -> bool:
    """True when `layout` holds a non-unit axis on the batch slot and Transpose(perm) puts
    another non-unit axis first: the transposed tensor in plain order needs the batch slot moved."""
    batch = {a for a in layout.groups[0] if shape[a] != 1}
    first = next((a for a in perm if shape[a] != 1), None)
    return bool(batch) and first is not None and first not in batch


def plain_slots(layout: Layout, shape: Sequence[int]) -> Layout | None:
    """The same slot contents reordered so the 4-D tensor is a plain reshape (a slot Transpose)."""
    blocks = [tuple(a for a in g if shape[a] != 1) for g in layout.groups]
    if any(list(b) != sorted(b) for b in blocks):
        return None
    filled = sorted((k for k, b in enumerate(blocks) if b), key=lambda k: blocks[k][0])
    ordered = [b for k in filled for b in blocks[k]]
    if ordered != sorted(ordered):
        return None
    empty = [k for k in range(SLOTS) if not blocks[k]]
    slots = empty[:1] + filled + empty[1:] if 0 in empty else filled + empty
    return Layout(tuple(layout.groups[k] for k in slots))
