"""The archive: members, `_mpk.json` fields, `_mla_stats.yaml`, determinism, reader errors."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import yaml

from compiler.archive import ARCHIVE_SUFFIX, read_archive
from compiler.compile import compile_model
from compiler.elf import read_elf
from compiler.lower.errors import ArchiveError
from compiler.runtime.pipeline import run_archive
from tests.lower_support import input_frames, load_example, reference_outputs


@pytest.fixture(scope="module")
def topk_archive(tmp_path_factory):
    folder = tmp_path_factory.mktemp("archive")
    result = compile_model(
        load_example("cnn_with_topk"),
        folder,
        model_name="topk",
        batch_size=2,
        custom_string="camera=front;v=3",
    )
    return result


def test_members_are_named_after_the_model_and_stages(topk_archive) -> None:
    assert topk_archive.archive.name == f"topk{ARCHIVE_SUFFIX}"
    with tarfile.open(topk_archive.archive) as tar:
        names = tar.getnames()
    assert names == sorted(names)
    assert "topk_mpk.json" in names and "topk_mla_stats.yaml" in names
    elves = [n for n in names if n.endswith(".elf")]
    assert elves == topk_archive.elf_files == ["topk_stage2_mla.elf", "topk_stage8_mla.elf"]
    assert [n for n in names if n.endswith(".onnx")] == ["topk_stage5_a65.onnx"]


def test_manifest_has_the_vendor_fields(topk_archive) -> None:
    archive = read_archive(topk_archive.archive)
    document = archive.manifest
    for key in (
        "name",
        "model_path",
        "model_checksum",
        "sequence",
        "model_sdk_version",
        "input_nodes",
        "plugins",
    ):
        assert key in document, key
    assert document["model_checksum"].startswith("sha256:")
    assert document["sequence"] == [p["name"] for p in document["plugins"]]
    assert document["input_nodes"][0]["size"] == 3 * 16 * 16 * 4
    processors = {p["processor"] for p in document["plugins"]}
    assert processors == {"MLA", "EV74", "A65"}
    for plugin in document["plugins"]:
        params = plugin["config_params"]
        assert params["desired_batch_size"] == 2 and params["actual_batch_size"] == 2
        assert {"number_of_quads_to_user", "kernel", "params"} <= set(params)
        assert "executable" in plugin["resources"]
        for node in (*plugin["input_nodes"], *plugin["output_nodes"]):
            assert {"name", "shape", "dtype", "layout", "size"} <= set(node)
        if plugin["processor"] == "MLA":
            assert params["number_of_quads_to_user"] == 4
            assert plugin["resources"]["executable"].endswith("_mla.elf")


def test_custom_string_is_readable_from_archive_and_elf(topk_archive) -> None:
    archive = read_archive(topk_archive.archive)
    assert archive.custom_string == "camera=front;v=3"
    for name in archive.elf_files:
        assert read_elf(archive.files[name]).metadata.custom_string == "camera=front;v=3"


def test_stats_list_every_mla_layer_with_cycles(topk_archive) -> None:
    archive = read_archive(topk_archive.archive)
    raw = yaml.safe_load(archive.files["topk_mla_stats.yaml"])
    assert sorted(raw) == list(range(len(raw)))
    names = [raw[i]["name"] for i in sorted(raw)]
    assert "MLA_0/conv2d_add_relu_0" in names and "MLA_1/conv2d_add_0" in names
    for entry in raw.values():
        assert 0 <= entry["start_cycle"] < entry["end_cycle"]


def test_compiling_twice_gives_identical_bytes(tmp_path) -> None:
    first = compile_model(load_example("yolo_head"), tmp_path / "a", model_name="m", batch_size=2)
    second = compile_model(load_example("yolo_head"), tmp_path / "b", model_name="m", batch_size=2)
    assert first.archive.read_bytes() == second.archive.read_bytes()
    header = first.archive.read_bytes()[:10]
    assert header[4:8] == b"\0\0\0\0"


def test_compression_shrinks_rodata_and_both_run_bit_exact(tmp_path) -> None:
    model = load_example("plain_cnn")
    packed = compile_model(model, tmp_path / "z", model_name="m", compress=True)
    plain = compile_model(model, tmp_path / "p", model_name="m", compress=False)
    elf = packed.elf_files[0]
    assert len(read_archive(packed.archive).files[elf]) < len(
        read_archive(plain.archive).files[elf]
    )
    feeds = input_frames(model, 2)
    reference = reference_outputs(model, feeds, 2)
    for result in (packed, plain):
        outputs, _ = run_archive(result.archive, feeds)
        np.testing.assert_array_equal(outputs["logits"], reference["logits"])


def test_reader_rejects_broken_archives(tmp_path, topk_archive) -> None:
    with pytest.raises(ArchiveError, match="no such file"):
        read_archive(tmp_path / "missing_mpk.tar.gz")
    garbage = tmp_path / "garbage_mpk.tar.gz"
    garbage.write_bytes(b"not a tarball")
    with pytest.raises(ArchiveError, match="readable"):
        read_archive(garbage)
    archive = read_archive(topk_archive.archive)
    partial = tmp_path / "partial_mpk.tar.gz"
    with tarfile.open(partial, "w:gz") as tar:
        for name, data in archive.files.items():
            if not name.endswith(".elf"):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ArchiveError, match="missing"):
        read_archive(partial)
    document = dict(archive.manifest, format_version=99)
    future = tmp_path / "future_mpk.tar.gz"
    with tarfile.open(future, "w:gz") as tar:
        data = json.dumps(document).encode()
        info = tarfile.TarInfo("topk_mpk.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ArchiveError, match="v99"):
        read_archive(future)


def test_the_summary_refuses_a_damaged_elf(tmp_path, topk_archive) -> None:
    """`surgery archive` decodes every ELF (CRCs checked), not only `surgery run`."""
    archive = read_archive(topk_archive.archive)
    damaged = tmp_path / "damaged_mpk.tar.gz"
    with tarfile.open(damaged, "w:gz") as tar:
        for name, data in archive.files.items():
            if name.endswith(".elf"):
                data = data[:-64] + bytes(b ^ 0xFF for b in data[-64:])
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ArchiveError, match="unreadable ELF"):
        read_archive(damaged).summary()


def test_the_summary_counts_each_mla_program_instructions(topk_archive) -> None:
    summary = read_archive(topk_archive.archive).summary()
    mla = [p for p in summary["plugins"] if p["processor"] == "MLA"]
    assert mla and all(p["instructions"] > 0 for p in mla)


def test_the_folder_compile_wrote_reads_as_its_one_archive(topk_archive) -> None:
    folder = topk_archive.archive.parent
    assert read_archive(folder).files == read_archive(topk_archive.archive).files


def test_a_folder_without_exactly_one_archive_is_refused_with_what_it_holds(tmp_path) -> None:
    with pytest.raises(ArchiveError, match="found 0 \\(none\\)"):
        read_archive(tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"{name}{ARCHIVE_SUFFIX}").write_bytes(b"")
    with pytest.raises(ArchiveError, match=f"found 2 \\(a{ARCHIVE_SUFFIX}, b{ARCHIVE_SUFFIX}\\)"):
        read_archive(tmp_path)
