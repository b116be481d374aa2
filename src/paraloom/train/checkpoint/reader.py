"""DCP's file reader, with its `.metadata` pickle read through an allow-list: a checkpoint cannot run code.

DCP writes `.metadata` with `pickle.dump` and its own reader loads it with `pickle.load`, so a
crafted one runs whatever its reduce calls name; the manifest's checksums cannot stop that (whoever
can write the folder can rewrite them too). Here the file is unpickled by `_Unpickler`, whose
`find_class` admits only the classes DCP's metadata holds for paraloom's checkpoints (recorded from
real ones: torch 2.13) and the torch values they are made of. torch's own `weights_only` unpickler
would be the convention, but it refuses protocol 4's FRAME opcode, which every `.metadata` starts
with. `BytesStorageMetadata` is left out on purpose: paraloom gives DCP tensors only (state_tree),
and DCP loads a bytes entry with `torch.load(weights_only=False)`.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata

from paraloom.config.errors import UserError

METADATA = ".metadata"  # DCP's name for it
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}  # storage_meta.checkpoint_id
ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, from torch's own table
    "torch": {"Size", *(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))},
    "pathlib": _PATHS,
    "pathlib._local": _PATHS,  # where Python 3.13 defines them
}


class _Unpickler(pickle.Unpickler):
    """pickle's unpickler, finding only the allowed globals; every callable a pickle calls is one of them."""

    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name not in ALLOWED.get(module, ()):
            raise UserError(f"checkpoint file {self.path} names {module}.{name}, which a paraloom checkpoint "
                            "never holds: refused (the file may be crafted)")
        return super().find_class(module, name)


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The DCP metadata in the file `path`, read through the allow-list; UserError if it is anything else."""
    try:
        with open(path, "rb") as f:
            metadata = _Unpickler(f, path).load()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a malformed pickle raises, said in one line
        raise UserError(f"checkpoint file {path} cannot be read as DCP metadata ({type(exc).__name__}: "
                        f"{exc}): refused") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UserError(f"checkpoint file {path} holds a {type(metadata).__name__}, not DCP metadata: "
                        "refused (the file may be crafted)")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise UserError(f"checkpoint file {path} points at {name!r}, outside its own folder: refused "
                            "(the file may be crafted)")
    return metadata


class CheckpointReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` through `read_metadata`'s allow-list instead of pickle."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.metadata_file = Path(path) / METADATA

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(self.metadata_file)
        # as FileSystemReader.read_metadata does after its pickle.load
        if getattr(metadata, "storage_meta", None) is None and hasattr(dcp_metadata, "StorageMeta"):
            metadata.storage_meta = dcp_metadata.StorageMeta()
        if getattr(metadata, "storage_meta", None) is not None and hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata
