"""The emulator's threads and reused memory images change no result.

An instruction's blocks run on `compiler.runtime.parallel`'s threads, each writing its own part
of the result: with blocks of a few elements (so every instruction has many, at odd sizes) the
outputs of 1, 2 and 3 threads must be identical, and equal to the reference executor's. An
emulator keeps its memory image between runs and re-poisons it first: a second run gives the
same result, and a plan that reads what nothing wrote, or overwrites a live tensor, is still
caught on a reused image (the previous run's values must not make it look right).
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

from compiler.elf import elf_bytes
from compiler.isa import Conv, Eltwise, EltwiseOp, Load, Move, Requant, Space, Store
from compiler.runtime import IntegerExecutor, emulator, emulator_ops, parallel
from compiler.runtime.emulator import POISON, Emulator
from tests.test_emulator_program import _lower, small_cnn
from tests.test_emulator_support import Codegen, random_codes

__all__ = ["small_cnn"]


@pytest.fixture(params=["tiny blocks", "a block per worker"])
def tiny_blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many blocks of 7 elements, or (with the default block size) every result split into
    one block per worker, so block boundaries move with the worker count."""
    if request.param == "tiny blocks":
        monkeypatch.setattr(emulator_ops, "BLOCK_ELEMENTS", 7)
    monkeypatch.setattr(emulator_ops, "PARALLEL_ELEMENTS", 1)
    monkeypatch.setattr(emulator, "PARALLEL_STORE_BYTES", 1)
    monkeypatch.setattr(emulator_ops, "TABLE_FACTOR", 0)


def _requant(rng: np.random.Generator, build: Codegen, channels: int) -> Requant:
    return Requant(
        build.const(rng.integers(2**30, 2**31, size=(channels,)), "int32"),
        build.const(rng.integers(6, 11, size=(channels,)), "int32"),
        -3,
        -128,
        127,
        "sima",
    )


def _odd_program() -> tuple[bytes, dict[str, np.ndarray]]:
    """Depthwise (stride 2) -> dense 3x3 CONV -> ELTWISE with the input of the second -> MOVE,
    on odd sizes (5 and 7 channels, 11 x 9 pixels)."""
    rng = np.random.default_rng(11)
    build = Codegen()
    x = random_codes(rng, (1, 5, 11, 9), "int8")
    source = build.input("x", x.shape, "int8", Space.DRAM, "HWC")
    depthwise = build.alloc((1, 5, 6, 5), "int8")
    dense = build.alloc((1, 7, 6, 5), "int8", layout="HWC")
    summed = build.alloc((1, 7, 6, 5), "int8")
    build.emit(
        Conv(
            input=source,
            weight=build.const(rng.integers(-127, 128, size=(5, 1, 3, 3)), "int8"),
            bias=build.const(rng.integers(-3000, 3000, size=5), "int32"),
            output=depthwise,
            requant=_requant(rng, build, 5),
            input_zero_point=4,
            pads=(1, 1, 1, 1),
            strides=(2, 2),
            group=5,
        ),
        Conv(
            input=depthwise,
            weight=build.const(rng.integers(-127, 128, size=(7, 5, 3, 3)), "int8"),
            bias=build.const(rng.integers(-3000, 3000, size=7), "int32"),
            output=dense,
            requant=_requant(rng, build, 7),
            input_zero_point=-3,
            pads=(1, 1, 1, 1),
        ),
        Eltwise(
            op=EltwiseOp.ADD,
            a=dense,
            b=dense,
            output=summed,
            requant=Requant(1518500250, 1, 2, -128, 127, "sima"),
            a_zero_point=-3,
            b_zero_point=-3,
            a_multiplier=1 << 30,
            a_shift=1,
            b_multiplier=1 << 29,
            b_shift=1,
            left_shift=4,
        ),
        Move(
            src=summed,
            dst=build.output("y", summed.shape, "int8", Space.DRAM, "HWC16"),
            input_zero_point=2,
            requant=Requant(1518500250, 0, -1, -128, 127, "sima"),
        ),
    )
    return elf_bytes(build.program()), {"x": x}


@pytest.mark.usefixtures("tiny_blocks")
def test_thread_counts_give_identical_results() -> None:
    data, inputs = _odd_program()
    with parallel.workers(1):
        single = Emulator(data).run(inputs)["y"]
    assert np.unique(single).size > 10
    for count in (2, 3):
        with parallel.workers(count):
            np.testing.assert_array_equal(Emulator(data).run(inputs)["y"], single)


@pytest.mark.usefixtures("tiny_blocks")
def test_threaded_runs_match_the_reference(small_cnn: IntegerExecutor) -> None:
    x = random_codes(np.random.default_rng(5), (1, 3, 8, 8), "int8")
    expected = small_cnn.run_integer({"x": x})["y"]
    program = _lower(small_cnn, x).program()
    for count in (1, 2, 3):
        with parallel.workers(count):
            np.testing.assert_array_equal(Emulator(program).run({"x": x})["y"], expected)


def test_for_each_runs_every_item_once_on_several_threads() -> None:
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()
    started = threading.Barrier(2, timeout=10)

    def work(item: int) -> None:
        if item < 2:
            started.wait()
        with lock:
            seen.append((item, threading.get_ident()))

    with parallel.workers(2):
        parallel.for_each(range(40), work)
    assert sorted(item for item, _ in seen) == list(range(40))
    assert len({thread for _, thread in seen}) == 2


def test_for_each_with_one_worker_stays_on_the_calling_thread() -> None:
    threads = set()
    with parallel.workers(1):
        parallel.for_each(range(10), lambda _: threads.add(threading.get_ident()))
    assert threads == {threading.get_ident()}


def test_for_each_raises_the_error_of_an_item_after_all_finish() -> None:
    """The slow item 0 is still running when item 3 fails: for_each waits for it."""
    done: list[int] = []

    def work(item: int) -> None:
        if item == 0:
            time.sleep(0.05)
        if item == 3:
            raise ValueError("item 3")
        done.append(item)

    with parallel.workers(3), pytest.raises(ValueError, match="item 3"):
        parallel.for_each(range(50), work)
    assert 0 in done


def test_nested_for_each_runs_serially_inside_an_item() -> None:
    totals = [0] * 6

    def outer(item: int) -> None:
        parallel.for_each(range(5), lambda inner: totals.__setitem__(item, totals[item] + inner))

    with parallel.workers(3):
        parallel.for_each(range(6), outer)
    assert totals == [10] * 6


@pytest.mark.parametrize("count", [1, 2, 3])
def test_shared_stores_equal_numpy_copies_even_when_overlapping(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(emulator, "PARALLEL_STORE_BYTES", 1)
    rng = np.random.default_rng(count)
    values = rng.integers(0, 255, size=(3, 7, 5), dtype=np.uint8)
    with parallel.workers(count):
        target = np.zeros((5, 7, 3), dtype=np.uint8).transpose(2, 1, 0)
        emulator._store(target, values)
        np.testing.assert_array_equal(target, values)
        buffer = rng.integers(0, 255, size=200, dtype=np.uint8)
        expected = buffer.copy()
        expected[3:103] = expected[0:100]
        emulator._store(buffer[3:103].reshape(10, 10), buffer[0:100].reshape(10, 10))
        np.testing.assert_array_equal(buffer, expected)


def test_default_worker_count_is_the_usable_cpus() -> None:
    with parallel.workers(None):
        assert parallel.worker_count() >= 1
        assert parallel.worker_count() == len(os.sched_getaffinity(0))


def test_a_second_run_reuses_the_image_and_agrees() -> None:
    data, inputs = _odd_program()
    emulator = Emulator(data)
    first = emulator.run(inputs)["y"]
    image = emulator.memory
    written = dict(emulator.stats.bytes_written)
    second = emulator.run(inputs)["y"]
    assert emulator.memory is image
    np.testing.assert_array_equal(second, first)
    assert emulator.stats.bytes_written == written


def test_a_dropped_emulators_image_goes_to_the_next_one() -> None:
    data, inputs = _odd_program()
    emulator = Emulator(data)
    first = emulator.run(inputs)["y"]
    image = emulator.memory
    del emulator
    gc.collect()
    following = Emulator(data)
    np.testing.assert_array_equal(following.run(inputs)["y"], first)
    assert following.memory is image
    other = Emulator(data, poison=None)
    other.run(inputs)
    assert other.memory is not image


def test_reading_before_writing_still_shows_poison_on_a_reused_image() -> None:
    """The STORE reads `hidden` before the LOAD writes it: without re-poisoning, a second run
    would read the first run's LOAD result and give the right-looking x."""
    build = Codegen()
    x = np.arange(12, dtype=np.uint8).reshape(3, 4)
    source = build.input("x", x.shape, "uint8")
    hidden = build.alloc(x.shape, "uint8")
    build.emit(
        Store(src=hidden, dst=build.output("y", x.shape, "uint8")),
        Load(src=source, dst=hidden),
    )
    emulator = Emulator(build.program())
    for _ in range(2):
        assert (emulator.run({"x": x})["y"] == POISON).all()


def test_an_overlapping_plan_stays_wrong_on_a_reused_image(small_cnn: IntegerExecutor) -> None:
    x = random_codes(np.random.default_rng(2), (1, 3, 8, 8), "int8")
    expected = small_cnn.run_integer({"x": x})["y"]
    emulator = Emulator(_lower(small_cnn, x, clobber=True).program())
    first = emulator.run({"x": x})["y"]
    second = emulator.run({"x": x})["y"]
    assert not np.array_equal(first, expected)
    np.testing.assert_array_equal(second, first)
