"""ELF64 files for MLA programs: one file per MLA segment, deterministic bytes.

Layout (docs/mla-isa.md, section "ELF file"):

    ELF header        ELFCLASS64, little-endian, ET_EXEC, e_machine EM_MLA, e_flags = ISA version
    .text             the encoded instruction stream (compiler.isa.encode)
    .rodata           CONST space: weights, biases, multipliers, shifts, tables; optionally zlib
                      compressed the standard ELF way (SHF_COMPRESSED + Elf64_Chdr, ELFCOMPRESS_ZLIB)
    .note.mla         two notes named "MLA": type 0x4D4C0001 = metadata JSON (sorted keys),
                      type 0x4D4C0002 = CRC-32 of .text, of the uncompressed .rodata, of the JSON
    .arena, .dram     SHT_NOBITS: the planned sizes of the on-chip arena and of DRAM
    .symtab/.strtab   one global object symbol per input / output tensor, in its space's section
    .shstrtab         section names

No program headers: the MLA runtime loads sections by name. Each memory space has a base
address (TEXT_BASE, CONST_BASE, ARENA_BASE, DRAM_BASE) so symbol values are unambiguous; the
descriptors in the instructions hold offsets relative to their space. Nothing time- or
host-dependent is written, so equal programs give equal bytes.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from compiler.isa import ISA_VERSION, IsaError, MlaProgram, ProgramMetadata, Space, decode

EM_MLA = 0x4D4C
"""e_machine of the virtual MLA ("ML"); not an assigned machine number, so tools print it raw."""

TEXT_BASE = 0x0
CONST_BASE = 0x1_0000_0000
ARENA_BASE = 0x2_0000_0000
DRAM_BASE = 0x3_0000_0000
SPACE_BASES = {Space.CONST: CONST_BASE, Space.ARENA: ARENA_BASE, Space.DRAM: DRAM_BASE}

NOTE_NAME = b"MLA\0"
NT_MLA_METADATA = 0x4D4C0001
NT_MLA_CHECKSUMS = 0x4D4C0002
ZLIB_LEVEL = 9

_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_CHDR = struct.Struct("<IIQQ")
_NOTE_HEADER = struct.Struct("<III")
_CHECKSUMS = struct.Struct("<IIIIQQ")

ET_EXEC = 2
SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB, SHT_NOTE, SHT_NOBITS = 1, 2, 3, 7, 8
SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR, SHF_COMPRESSED = 0x1, 0x2, 0x4, 0x800
ELFCOMPRESS_ZLIB = 1
STB_GLOBAL = 1
STT_OBJECT, STT_FUNC = 1, 2
ENTRY_SYMBOL = "mla_main"


class ElfError(ValueError):
    """A file is not a valid MLA ELF (or is damaged); the message says what is wrong."""


@dataclass
class _Section:
    name: str
    type: int
    flags: int = 0
    address: int = 0
    data: bytes = b""
    size: int | None = None
    link: int = 0
    info: int = 0
    align: int = 1
    entsize: int = 0

    @property
    def file_size(self) -> int:
        return 0 if self.type == SHT_NOBITS else len(self.data)


def _note(note_type: int, desc: bytes) -> bytes:
    """One ELF note: header, name padded to 4, descriptor padded to 4."""
    padded = desc + b"\0" * (-len(desc) % 4)
    return _NOTE_HEADER.pack(len(NOTE_NAME), len(desc), note_type) + NOTE_NAME + padded


class _StringTable:
    def __init__(self) -> None:
        self.data = bytearray(b"\0")
        self._offsets: dict[str, int] = {"": 0}

    def add(self, text: str) -> int:
        if text not in self._offsets:
            encoded = text.encode()
            if b"\0" in encoded:
                raise ElfError(f"name {text!r} contains a NUL byte")
            self._offsets[text] = len(self.data)
            self.data.extend(encoded + b"\0")
        return self._offsets[text]


def elf_bytes(program: MlaProgram, *, compress: bool = False) -> bytes:
    """The ELF image of one MLA program (deterministic)."""
    metadata = program.metadata
    text = program.text
    rodata = program.rodata
    meta_json = metadata.to_bytes()
    checksums = _CHECKSUMS.pack(
        zlib.crc32(text), zlib.crc32(rodata), zlib.crc32(meta_json), 0, len(text), len(rodata)
    )
    notes = _note(NT_MLA_METADATA, meta_json) + _note(NT_MLA_CHECKSUMS, checksums)
    if compress:
        payload = zlib.compress(rodata, ZLIB_LEVEL)
        rodata_section = _Section(
            ".rodata",
            SHT_PROGBITS,
            SHF_COMPRESSED,
            data=_CHDR.pack(ELFCOMPRESS_ZLIB, 0, len(rodata), 16) + payload,
            align=8,
        )
    else:
        rodata_section = _Section(".rodata", SHT_PROGBITS, SHF_ALLOC, CONST_BASE, rodata, align=16)
    sections = [
        _Section("", 0),
        _Section(".text", SHT_PROGBITS, SHF_ALLOC | SHF_EXECINSTR, TEXT_BASE, text, align=16),
        rodata_section,
        _Section(".note.mla", SHT_NOTE, data=notes, align=4),
        _Section(".arena", SHT_NOBITS, SHF_ALLOC | SHF_WRITE, ARENA_BASE, size=metadata.arena_size),
        _Section(".dram", SHT_NOBITS, SHF_ALLOC | SHF_WRITE, DRAM_BASE, size=metadata.dram_size),
    ]
    index = {section.name: i for i, section in enumerate(sections)}
    space_sections = {Space.ARENA: ".arena", Space.DRAM: ".dram", Space.CONST: ".rodata"}
    strtab = _StringTable()
    symbols = [_SYMBOL.pack(0, 0, 0, 0, 0, 0)]
    symbols.append(
        _SYMBOL.pack(
            strtab.add(ENTRY_SYMBOL),
            (STB_GLOBAL << 4) | STT_FUNC,
            0,
            index[".text"],
            TEXT_BASE,
            len(text),
        )
    )
    for info in metadata.tensors:
        if info.role == "intermediate":
            continue
        low, high = info.tensor.span()
        symbols.append(
            _SYMBOL.pack(
                strtab.add(info.name),
                (STB_GLOBAL << 4) | STT_OBJECT,
                0,
                index[space_sections[info.tensor.space]],
                SPACE_BASES[info.tensor.space] + low,
                high - low,
            )
        )
    strtab_index = len(sections) + 1
    sections.append(
        _Section(
            ".symtab",
            SHT_SYMTAB,
            data=b"".join(symbols),
            link=strtab_index,
            info=1,
            align=8,
            entsize=_SYMBOL.size,
        )
    )
    sections.append(_Section(".strtab", SHT_STRTAB, data=bytes(strtab.data)))
    shstrtab = _StringTable()
    name_offsets = [shstrtab.add(section.name) for section in sections]
    name_offsets.append(shstrtab.add(".shstrtab"))
    sections.append(_Section(".shstrtab", SHT_STRTAB, data=bytes(shstrtab.data)))

    body = bytearray(b"\0" * _ELF_HEADER.size)
    offsets = []
    for section in sections:
        body.extend(b"\0" * (-len(body) % max(section.align, 1)))
        offsets.append(len(body) if section.type else 0)
        body.extend(section.data if section.type != SHT_NOBITS else b"")
    body.extend(b"\0" * (-len(body) % 8))
    section_table = len(body)
    for section, offset, name in zip(sections, offsets, name_offsets, strict=True):
        size = section.size if section.size is not None else len(section.data)
        body.extend(
            _SECTION_HEADER.pack(
                name,
                section.type,
                section.flags,
                section.address,
                offset,
                size,
                section.link,
                section.info,
                section.align if section.type else 0,
                section.entsize,
            )
        )
    ident = b"\x7fELF" + bytes([2, 1, 1, 0, 0]) + b"\0" * 7
    body[: _ELF_HEADER.size] = _ELF_HEADER.pack(
        ident,
        ET_EXEC,
        EM_MLA,
        1,
        TEXT_BASE,
        0,
        section_table,
        ISA_VERSION,
        _ELF_HEADER.size,
        0,
        0,
        _SECTION_HEADER.size,
        len(sections),
        len(sections) - 1,
    )
    return bytes(body)


def write_elf(program: MlaProgram, path: str | Path, *, compress: bool = False) -> Path:
    """Write one MLA segment's ELF file; returns the path."""
    path = Path(path)
    path.write_bytes(elf_bytes(program, compress=compress))
    return path


@dataclass(frozen=True)
class _SectionEntry:
    name: str
    type: int
    flags: int
    address: int
    offset: int
    size: int


def _sections(data: bytes) -> dict[str, _SectionEntry]:
    if len(data) < _ELF_HEADER.size:
        raise ElfError(f"{len(data)} bytes is too short for an ELF header")
    header = _ELF_HEADER.unpack_from(data)
    ident, e_type, machine, _, _, _, shoff, flags, _, _, _, shentsize, shnum, shstrndx = header
    if ident[:4] != b"\x7fELF":
        raise ElfError("not an ELF file (bad magic)")
    if ident[4] != 2 or ident[5] != 1:
        raise ElfError("not a little-endian ELF64 file")
    if e_type != ET_EXEC or machine != EM_MLA:
        raise ElfError(f"not an MLA program (e_type {e_type}, e_machine {machine:#x})")
    if flags != ISA_VERSION:
        raise ElfError(f"MLA ISA version {flags}; this toolkit reads version {ISA_VERSION}")
    if shentsize != _SECTION_HEADER.size or shoff + shnum * shentsize > len(data):
        raise ElfError("section header table is truncated or malformed")
    if not 0 < shstrndx < shnum:
        raise ElfError("no section-name string table")
    raw = [_SECTION_HEADER.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    for entry in raw:
        if entry[1] != SHT_NOBITS and entry[4] + entry[5] > len(data):
            raise ElfError("a section extends past the end of the file (truncated?)")
    names_entry = raw[shstrndx]
    names = data[names_entry[4] : names_entry[4] + names_entry[5]]
    sections = {}
    for name_offset, kind, sh_flags, address, offset, size, *_ in raw[1:]:
        end = names.find(b"\0", name_offset)
        if name_offset >= len(names) or end < 0:
            raise ElfError("a section name points outside the string table")
        name = names[name_offset:end].decode(errors="replace")
        sections[name] = _SectionEntry(name, kind, sh_flags, address, offset, size)
    return sections


def _section_data(data: bytes, sections: dict[str, _SectionEntry], name: str) -> bytes:
    if name not in sections:
        raise ElfError(f"missing section {name}")
    entry = sections[name]
    raw = data[entry.offset : entry.offset + entry.size]
    if not entry.flags & SHF_COMPRESSED:
        return raw
    if len(raw) < _CHDR.size:
        raise ElfError(f"{name}: compression header truncated")
    kind, _, size, _ = _CHDR.unpack_from(raw)
    if kind != ELFCOMPRESS_ZLIB:
        raise ElfError(f"{name}: unsupported compression type {kind}")
    try:
        inflated = zlib.decompress(raw[_CHDR.size :])
    except zlib.error as error:
        raise ElfError(f"{name}: compressed data is corrupt ({error})") from error
    if len(inflated) != size:
        raise ElfError(f"{name}: decompressed to {len(inflated)} bytes, header says {size}")
    return inflated


def _notes(raw: bytes) -> dict[int, bytes]:
    notes = {}
    position = 0
    while position + _NOTE_HEADER.size <= len(raw):
        name_size, desc_size, note_type = _NOTE_HEADER.unpack_from(raw, position)
        position += _NOTE_HEADER.size
        name = raw[position : position + name_size]
        position += name_size + (-name_size % 4)
        desc = raw[position : position + desc_size]
        position += desc_size + (-desc_size % 4)
        if len(desc) != desc_size:
            raise ElfError(".note.mla is truncated")
        if name == NOTE_NAME:
            notes[note_type] = desc
    return notes


def read_elf(source: str | Path | bytes) -> MlaProgram:
    """Read an MLA ELF (a path or the file's bytes), checking it is intact.

    Raises `ElfError` naming the problem: not an ELF, wrong machine or ISA version, missing or
    truncated sections, a checksum mismatch (damaged .text, .rodata or metadata), undecodable
    instructions.
    """
    data = bytes(source) if isinstance(source, bytes | bytearray) else Path(source).read_bytes()
    sections = _sections(data)
    text = _section_data(data, sections, ".text")
    rodata = _section_data(data, sections, ".rodata")
    notes = _notes(_section_data(data, sections, ".note.mla"))
    if NT_MLA_METADATA not in notes or NT_MLA_CHECKSUMS not in notes:
        raise ElfError(".note.mla lacks the metadata or checksum note")
    meta_json = notes[NT_MLA_METADATA]
    checksums = notes[NT_MLA_CHECKSUMS]
    if len(checksums) != _CHECKSUMS.size:
        raise ElfError("the checksum note has the wrong size")
    text_crc, rodata_crc, meta_crc, _, text_size, rodata_size = _CHECKSUMS.unpack(checksums)
    for what, blob, crc, size in (
        (".text", text, text_crc, text_size),
        (".rodata", rodata, rodata_crc, rodata_size),
        ("metadata", meta_json, meta_crc, len(meta_json)),
    ):
        if len(blob) != size or zlib.crc32(blob) != crc:
            raise ElfError(
                f"{what} is damaged: its CRC-32 or size does not match the checksum note"
            )
    try:
        metadata = ProgramMetadata.from_json(json.loads(meta_json))
    except (ValueError, KeyError, TypeError) as error:
        raise ElfError(f"metadata is not valid: {error}") from error
    try:
        instructions = decode(text)
    except IsaError as error:
        raise ElfError(f".text does not decode: {error}") from error
    for name, size in ((".arena", metadata.arena_size), (".dram", metadata.dram_size)):
        if name not in sections or sections[name].size != size:
            raise ElfError(f"{name} size disagrees with the metadata ({size} bytes)")
    return MlaProgram(tuple(instructions), rodata, metadata)
