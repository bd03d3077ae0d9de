"""MLA ELF files: exact round trips, determinism, compression, standard tools, damage detection."""

from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile

from compiler.elf import (
    DRAM_BASE,
    NT_MLA_METADATA,
    ElfError,
    elf_bytes,
    read_elf,
    write_elf,
)
from compiler.isa import (
    Conv,
    Load,
    MlaProgram,
    Pool,
    PoolOp,
    Space,
    Store,
)
from compiler.runtime.emulator import Emulator, EmulatorError
from tests.test_emulator_support import Codegen, random_codes


def _program(custom_string: str = "hello") -> tuple[MlaProgram, dict[str, np.ndarray]]:
    """LOAD (HWC) -> CONV -> POOL -> STORE (HWC16): a complete little segment."""
    rng = np.random.default_rng(0)
    build = Codegen("segment0")
    x = build.input("input.1", (1, 3, 6, 6), "int8", Space.DRAM, "HWC")
    staged = build.alloc(x.shape, "int8")
    conv_out = build.alloc((1, 8, 6, 6), "int8")
    pooled = build.alloc((1, 8, 3, 3), "int8")
    y = build.output("output", (1, 8, 3, 3), "int8", Space.DRAM, "HWC16")
    weight = build.const(rng.integers(-127, 128, (8, 3, 3, 3)), "int8")
    bias = build.const(rng.integers(-500, 500, 8), "int32")
    requant = build.requant(
        rng.integers(2**30, 2**31 - 1, 8), np.full(8, 7), -3, -3, 127, "sima", table_shape=(8,)
    )
    build.layers = ["conv_relu", "maxpool"]
    build.emit(
        Load(src=x, dst=staged),
        Conv(
            input=staged,
            weight=weight,
            bias=bias,
            output=conv_out,
            requant=requant,
            input_zero_point=1,
            pads=(1, 1, 1, 1),
        ),
        Pool(
            op=PoolOp.MAX,
            input=conv_out,
            output=pooled,
            kernel=(2, 2),
            strides=(2, 2),
            pad_value=-128,
            layer=1,
        ),
        Store(src=pooled, dst=y, layer=1),
    )
    program = build.program()
    metadata = dataclasses.replace(program.metadata, custom_string=custom_string)
    program = MlaProgram(program.instructions, program.rodata, metadata)
    return program, {"input.1": random_codes(rng, (1, 3, 6, 6), "int8")}


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_is_exact_and_deterministic(compress: bool) -> None:
    program, inputs = _program()
    data = elf_bytes(program, compress=compress)
    assert elf_bytes(program, compress=compress) == data
    assert read_elf(data) == program
    expected = Emulator(program).run(inputs)
    np.testing.assert_array_equal(Emulator(data).run(inputs)["output"], expected["output"])


def test_compression_shrinks_rodata_and_write_elf_writes_a_file(tmp_path: Path) -> None:
    program, _ = _program()
    padded = MlaProgram(program.instructions, program.rodata + bytes(4096), program.metadata)
    plain = elf_bytes(padded)
    packed = elf_bytes(padded, compress=True)
    assert len(packed) < len(plain) - 3000
    path = write_elf(padded, tmp_path / "segment0.elf", compress=True)
    assert path.read_bytes() == packed
    assert read_elf(path).rodata == padded.rodata


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils readelf not installed")
@pytest.mark.parametrize("compress", [False, True])
def test_readelf_reads_the_file_without_complaint(tmp_path: Path, compress: bool) -> None:
    program, _ = _program()
    path = write_elf(program, tmp_path / "segment0.elf", compress=compress)
    result = subprocess.run(
        ["readelf", "-a", "-W", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in (result.stdout + result.stderr).lower()
    assert "error" not in (result.stdout + result.stderr).lower()
    assert "input.1" in result.stdout and "output" in result.stdout
    assert ".rodata" in result.stdout and ".note.mla" in result.stdout
    notes = subprocess.run(
        ["readelf", "-n", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "MLA" in notes and f"{NT_MLA_METADATA:#x}" in notes


@pytest.mark.parametrize("compress", [False, True])
def test_pyelftools_reads_sections_symbols_and_notes(tmp_path: Path, compress: bool) -> None:
    program, _ = _program()
    path = write_elf(program, tmp_path / "segment0.elf", compress=compress)
    with path.open("rb") as handle:
        elf = ELFFile(handle)
        assert elf["e_machine"] == 0x4D4C or elf["e_machine"] == "<unknown>: 0x4d4c"
        assert elf.get_section_by_name(".text").data() == program.text
        assert elf.get_section_by_name(".rodata").data() == program.rodata
        assert elf.get_section_by_name(".arena")["sh_size"] == program.metadata.arena_size
        symbols = {s.name: s for s in elf.get_section_by_name(".symtab").iter_symbols()}
        output = program.metadata.tensor("output").tensor
        assert symbols["output"]["st_value"] == DRAM_BASE + output.offset
        assert symbols["output"]["st_size"] == output.span()[1] - output.span()[0]
        assert symbols["mla_main"]["st_info"]["type"] == "STT_FUNC"
        notes = list(elf.get_section_by_name(".note.mla").iter_notes())
        assert [n["n_name"] for n in notes] == ["MLA", "MLA"]
        assert b'"custom_string":"hello"' in notes[0]["n_descdata"]


def _section(data: bytes, name: str) -> tuple[int, int]:
    with io.BytesIO(data) as handle:
        section = ELFFile(handle).get_section_by_name(name)
        return section["sh_offset"], section["sh_size"]


@pytest.mark.parametrize(
    ("section", "compress", "message"),
    [
        (".text", False, r"\.text is damaged"),
        (".rodata", False, r"\.rodata is damaged"),
        (".rodata", True, r"\.rodata: compressed data is corrupt|\.rodata is damaged"),
        (".note.mla", False, "metadata is damaged|metadata is not valid|checksum"),
    ],
)
def test_a_damaged_file_gives_a_clear_error(section: str, compress: bool, message: str) -> None:
    program, inputs = _program()
    data = bytearray(elf_bytes(program, compress=compress))
    offset, size = _section(bytes(data), section)
    data[offset + size // 2 + 4] ^= 0x5A
    with pytest.raises(ElfError, match=message):
        read_elf(bytes(data))
    with pytest.raises(ElfError):
        Emulator(bytes(data)).run(inputs)


def test_files_that_are_not_mla_programs_are_refused(tmp_path: Path) -> None:
    program, _ = _program()
    data = elf_bytes(program)
    with pytest.raises(ElfError, match="too short"):
        read_elf(data[:20])
    with pytest.raises(ElfError, match="bad magic"):
        read_elf(b"\0ELF" + data[4:])
    with pytest.raises(ElfError, match="e_machine"):
        read_elf(data[:18] + (62).to_bytes(2, "little") + data[20:])
    with pytest.raises(ElfError, match="ISA version 7"):
        read_elf(data[:48] + (7).to_bytes(4, "little") + data[52:])
    with pytest.raises(ElfError, match="truncated|past the end"):
        read_elf(data[: len(data) // 2])
    if Path("/bin/true").exists():
        with pytest.raises(ElfError, match="not an MLA program"):
            read_elf(Path("/bin/true"))


def test_custom_string_batch_and_quads_survive_and_differ_in_bytes() -> None:
    first, _ = _program("one")
    second, _ = _program("two")
    assert elf_bytes(first) != elf_bytes(second)
    assert read_elf(elf_bytes(second)).metadata.custom_string == "two"


def test_emulator_refuses_programs_the_hardware_cannot_hold() -> None:
    program, _ = _program()
    too_big = dataclasses.replace(program.metadata, arena_size=64 * 2**20)
    with pytest.raises(EmulatorError, match="arena bytes"):
        Emulator(MlaProgram(program.instructions, program.rodata, too_big))
    five_quads = dataclasses.replace(program.metadata, quads=5)
    with pytest.raises(EmulatorError, match="quads"):
        Emulator(MlaProgram(program.instructions, program.rodata, five_quads))
