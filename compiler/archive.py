"""`<name>_mpk.tar.gz`: the deployable archive — writer, reader and validation.

Members (docs/archive-format.md):

    <name>_mpk.json              the pipeline: plugins in order, their processors, kernels,
                                 I/O tensors (shape, dtype, layout, size) and executables
    <name>_mla_stats.yaml        per MLA layer: idx: {name, start_cycle, end_cycle}
    <name>_stage<k>_mla.elf      one per MLA segment (compiler.elf)
    <name>_stage<k>_<proc>.onnx  one per ONNX host stage (EV74 or A65)

The archive is deterministic: members sorted by name, tar headers with mtime 0, uid/gid 0 and
no user names, gzip with mtime 0 and no file name, JSON with sorted keys. Compiling the same
model with the same options twice gives byte-identical archives.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import yaml

from compiler.isa import ISA_VERSION, MlaProgram
from compiler.lower.errors import ArchiveError, ArchiveNotFoundError
from compiler.lower.pipeline import PROCESSOR_NAMES, CompiledModel, PipelineStage

FORMAT = "model-surgery-mpk"
FORMAT_VERSION = 1
ARCHIVE_SUFFIX = "_mpk.tar.gz"


def sdk_version() -> str:
    try:
        version = importlib_metadata.version("model-surgery")
    except importlib_metadata.PackageNotFoundError:
        version = "0.0.0"
    return f"model-surgery {version} (MLA ISA {ISA_VERSION})"


def model_checksum(data: bytes) -> str:
    return checksum_of_digest(hashlib.sha256(data).hexdigest())


def checksum_of_digest(sha256_hex: str) -> str:
    """`model_checksum` of a file whose hex sha256 is known (a workspace version's record)."""
    return "sha256:" + sha256_hex


def check_compiled_from(
    manifest: Mapping[str, Any], path: Path, label: str = "", hint: str | None = None
) -> None:
    """ArchiveError unless the file at `path` is the model the archive was compiled from
    (its recorded checksum): a bit-exact comparison against any other model is no evidence
    about the compiled program, in either direction."""
    if model_checksum(path.read_bytes()) == manifest.get("model_checksum"):
        return
    recorded = manifest.get("model_path") or "its recorded model_path"
    raise ArchiveError(
        f"{label or path} is not the model this archive was compiled from (checksum differs; "
        f"it was compiled from {recorded})",
        hint=hint or "compare against the QDQ model the archive was compiled from",
    )


def executable_name(model: str, sequence: int, stage: PipelineStage) -> str | None:
    """File of a plugin inside the archive (None for built-in CVU kernels)."""
    if stage.processor == "MLA":
        return f"{model}_stage{sequence}_mla.elf"
    if stage.graph is not None:
        return f"{model}_stage{sequence}_{PROCESSOR_NAMES[stage.processor].lower()}.onnx"
    return None


def manifest(compiled: CompiledModel, model_path: str, checksum: str) -> dict[str, Any]:
    """The `_mpk.json` document."""
    plugins = []
    for sequence, stage in enumerate(compiled.stages):
        executable = executable_name(compiled.name, sequence, stage)
        plugins.append(
            {
                "name": stage.name,
                "sequence": sequence,
                "processor": PROCESSOR_NAMES[stage.processor],
                "config_params": stage.params,
                "input_nodes": [t.to_dict() for t in stage.inputs],
                "output_nodes": [t.to_dict() for t in stage.outputs],
                "resources": {
                    "executable": executable,
                    "builtin_kernel": None if executable else stage.kernel,
                },
            }
        )
    options = compiled.options
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": compiled.name,
        "model_path": model_path,
        "model_checksum": checksum,
        "model_sdk_version": sdk_version(),
        "target": compiled.target,
        "requantization_mode": compiled.partition.mode,
        "custom_string": options.custom_string,
        "compile_options": {
            "batch_size": options.batch_size,
            "memory_plan_strategy": options.memory_plan_strategy,
            "compute_order": options.compute_order,
            "single_core_mode": options.single_core_mode,
            "compress": options.compress,
            "arena_bytes": options.arena_bytes,
            "tessellate_parameters": {
                name: params.to_dict()
                for name, params in sorted((options.tessellate_parameters or {}).items())
            },
        },
        "mla_segments": compiled.partition.coverage.mla_segments,
        "sequence": [stage.name for stage in compiled.stages],
        "input_nodes": [t.to_dict() for t in compiled.inputs],
        "output_nodes": [t.to_dict() for t in compiled.outputs],
        "plugins": plugins,
        "notes": list(compiled.notes),
    }


def mla_stats(compiled: CompiledModel) -> dict[int, dict[str, Any]]:
    """Per MLA layer, in pipeline order: its name and static-schedule start / end cycle."""
    stats: dict[int, dict[str, Any]] = {}
    for segment in compiled.segments:
        names = segment.program.metadata.layers
        for layer, (start, end) in sorted(segment.static.by_layer().items()):
            stats[len(stats)] = {
                "name": names[layer] if layer < len(names) else f"{segment.name}/layer_{layer}",
                "start_cycle": int(start),
                "end_cycle": int(end),
            }
    return stats


def archive_members(compiled: CompiledModel, model_path: str, checksum: str) -> dict[str, bytes]:
    """Every file of the archive, by name."""
    name = compiled.name
    members: dict[str, bytes] = {}
    document = manifest(compiled, model_path, checksum)
    members[f"{name}_mpk.json"] = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
    members[f"{name}_mla_stats.yaml"] = yaml.safe_dump(
        mla_stats(compiled), sort_keys=True, default_flow_style=None, width=1000
    ).encode()
    for sequence, stage in enumerate(compiled.stages):
        executable = executable_name(name, sequence, stage)
        if executable is None:
            continue
        if stage.segment is not None:
            members[executable] = stage.segment.elf
        elif stage.graph is not None:
            members[executable] = stage.graph.SerializeToString(deterministic=True)
    return members


def write_tar_gz(members: Mapping[str, bytes], path: Path) -> Path:
    """A deterministic .tar.gz: sorted members, zeroed times and owners, no gzip file name."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member_name in sorted(members):
            data = members[member_name]
            info = tarfile.TarInfo(member_name)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    compressed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=9) as gz:
        gz.write(buffer.getvalue())
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(compressed.getvalue())
    temporary.replace(path)
    return path


def write_archive(
    compiled: CompiledModel, output_dir: str | Path, *, model_path: str, checksum: str
) -> Path:
    """Write `<output_dir>/<name>_mpk.tar.gz` and return its path."""
    members = archive_members(compiled, model_path, checksum)
    return write_tar_gz(members, Path(output_dir) / f"{compiled.name}{ARCHIVE_SUFFIX}")


# --- reading ----------------------------------------------------------------------------------------


@dataclass
class Archive:
    """A read archive: the manifest, the stats and every member's bytes."""

    path: Path
    manifest: dict[str, Any]
    stats: dict[int, dict[str, Any]]
    files: dict[str, bytes] = field(repr=False)

    @property
    def name(self) -> str:
        return str(self.manifest["name"])

    @property
    def custom_string(self) -> str:
        return str(self.manifest.get("custom_string", ""))

    @property
    def plugins(self) -> list[dict[str, Any]]:
        return list(self.manifest["plugins"])

    @property
    def elf_files(self) -> list[str]:
        return sorted(n for n in self.files if n.endswith(".elf"))

    @property
    def desired_batch_size(self) -> int:
        return int(self.plugins[0]["config_params"]["desired_batch_size"]) if self.plugins else 1

    @property
    def actual_batch_size(self) -> int:
        return int(self.plugins[0]["config_params"]["actual_batch_size"]) if self.plugins else 1

    def executable(self, plugin: Mapping[str, Any]) -> bytes:
        name = plugin["resources"].get("executable")
        if not name:
            raise ArchiveError(f"plugin {plugin['name']!r} has no executable (built-in kernel)")
        if name not in self.files:
            raise ArchiveError(f"{self.path}: plugin {plugin['name']!r} needs missing {name!r}")
        return self.files[name]

    @cached_property
    def programs(self) -> dict[str, MlaProgram]:
        """MLA plugin name -> its program, decoded from the ELF."""
        from compiler.elf import ElfError, read_elf

        programs = {}
        for plugin in self.plugins:
            if plugin["processor"] == "MLA":
                try:
                    programs[plugin["name"]] = read_elf(self.executable(plugin))
                except (ElfError, ValueError) as error:
                    raise ArchiveError(f"{plugin['name']}: unreadable ELF ({error})") from error
        return programs

    def summary(self) -> dict[str, Any]:
        """What `surgery archive` prints: the pipeline, sizes and the MLA programs. Every ELF
        is decoded on the way (its CRCs checked): a damaged one is an ArchiveError here, not
        first at `surgery run`."""
        programs = self.programs
        plugins = []
        for plugin in self.plugins:
            entry = {
                "name": plugin["name"],
                "sequence": plugin["sequence"],
                "processor": plugin["processor"],
                "kernel": plugin["config_params"].get("kernel"),
                "executable": plugin["resources"].get("executable"),
                "inputs": [n["name"] for n in plugin["input_nodes"]],
                "outputs": [n["name"] for n in plugin["output_nodes"]],
            }
            params = plugin["config_params"].get("params", {})
            if plugin["processor"] == "MLA":
                plan = params.get("memory_plan", {})
                entry.update(
                    {
                        "static_cycles": params.get("static_cycles"),
                        "stall_aware_cycles": params.get("stall_aware_cycles"),
                        "peak_bytes": plan.get("peak_bytes"),
                        "lower_bound_bytes": plan.get("lower_bound_bytes"),
                        "instructions": len(programs[plugin["name"]].instructions),
                    }
                )
            plugins.append(entry)
        return {
            "archive": str(self.path),
            "name": self.name,
            "target": self.manifest.get("target"),
            "model_path": self.manifest.get("model_path"),
            "model_checksum": self.manifest.get("model_checksum"),
            "model_sdk_version": self.manifest.get("model_sdk_version"),
            "custom_string": self.custom_string,
            "desired_batch_size": self.desired_batch_size,
            "actual_batch_size": self.actual_batch_size,
            "elf_files": self.elf_files,
            "files": {name: len(data) for name, data in sorted(self.files.items())},
            "input_nodes": self.manifest["input_nodes"],
            "output_nodes": self.manifest["output_nodes"],
            "plugins": plugins,
            "notes": self.manifest.get("notes", []),
        }


def _archive_in(path: Path) -> Path:
    """`path`, or the one archive in folder `path` (what `surgery compile -o DIR` wrote)."""
    if not path.exists():
        raise ArchiveNotFoundError(f"{path}: no such file")
    if not path.is_dir():
        return path
    # regular files only: a link could lead out of a folder a server was allowed to read
    found = sorted(p for p in path.glob(f"*{ARCHIVE_SUFFIX}") if p.is_file() and not p.is_symlink())
    if len(found) != 1:
        listed = ", ".join(p.name for p in found[:5]) or "none"
        raise ArchiveError(
            f"{path}: a folder; expected one *{ARCHIVE_SUFFIX} archive in it, found "
            f"{len(found)} ({listed})"
        )
    return found[0]


def read_archive(path: str | Path) -> Archive:
    """Open an archive and check that it is complete (manifest, stats, every executable)."""
    path = _archive_in(Path(path))
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            files = {}
            for member in tar.getmembers():
                if not member.isfile():
                    continue
                handle = tar.extractfile(member)
                if handle is not None:
                    files[member.name] = handle.read()
    except (tarfile.TarError, OSError, EOFError) as error:
        if path.suffix == ".onnx":
            raise ArchiveError(
                f"{path}: an ONNX model, not a compiled archive",
                hint=f"compile it first (surgery compile {path}), then run the archive",
            ) from None
        raise ArchiveError(f"{path}: not a readable .tar.gz ({error})") from None
    manifests = [n for n in files if n.endswith("_mpk.json")]
    if len(manifests) != 1:
        raise ArchiveError(f"{path}: expected one *_mpk.json, found {len(manifests)}")
    try:
        document = json.loads(files[manifests[0]])
    except json.JSONDecodeError as error:
        raise ArchiveError(f"{path}: {manifests[0]} is not JSON ({error})") from None
    if document.get("format") != FORMAT or document.get("format_version") != FORMAT_VERSION:
        raise ArchiveError(
            f"{path}: format {document.get('format')!r} v{document.get('format_version')}; "
            f"this toolkit reads {FORMAT!r} v{FORMAT_VERSION}"
        )
    stats_name = f"{document['name']}_mla_stats.yaml"
    try:
        stats = yaml.safe_load(files.get(stats_name, b"{}")) or {}
    except yaml.YAMLError as error:
        raise ArchiveError(f"{path}: {stats_name} is not YAML ({error})") from None
    archive = Archive(path, document, stats, files)
    for plugin in archive.plugins:
        executable = plugin["resources"].get("executable")
        if executable and executable not in files:
            raise ArchiveError(f"{path}: plugin {plugin['name']!r} needs missing {executable!r}")
    return archive
