"""Byte-level text: the Python standard library's own source files, real text on every machine.

Files are visited in a fixed pseudo-random order (crc32 of the path relative to the library
root) and each file goes wholly to training or to validation by a hash of its path seeded with
`split_seed`, so the split is deterministic and validation text comes from files never trained on.
Sample i holds bytes [i * seq_len, (i + 1) * seq_len + 1): inputs are its first `seq_len` bytes,
targets its last `seq_len` (every byte is a target once).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path

import torch

from paraloom.config.errors import UserError
from paraloom.data.split import Split

VOCAB = 256
PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})  # installed packages, not the library


def stdlib_files(root: Path | None = None) -> list[tuple[int, Path]]:
    """(hash, path) of every standard-library .py file outside site-packages, in hash order.
    A walk that never enters site-packages: every worker lists the library, and `Path.rglob`
    visiting everything took 0.5-1 s of each one's start."""
    root = stdlib_root() if root is None else root
    if not PACKAGE_DIRS.isdisjoint(root.parts):
        return []
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in PACKAGE_DIRS]
        relative = os.path.relpath(folder, root)
        for name in names:
            if name.endswith(".py"):
                key = name if relative == "." else os.path.join(relative, name)
                found.append((zlib.crc32(key.encode()), Path(folder, name)))
    return sorted(found)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def windows(data: bytes, seq_len: int, role: str = "training") -> tuple[torch.Tensor, torch.Tensor]:
    n = (len(data) - 1) // seq_len
    if n < 1:  # a sample is seq_len bytes and the byte after them
        raise UserError(f"the text corpus holds {len(data)} {role} bytes, too few for one sample of "
                        f"data.seq_len={seq_len}: lower data.seq_len or raise data.text_bytes above it")
    flat = torch.frombuffer(bytearray(data[: n * seq_len + 1]), dtype=torch.uint8).long()
    x = flat[:-1].view(n, seq_len)
    y = flat[1:].view(n, seq_len)
    return x, y


def load_text(*, seq_len: int = 128, text_bytes: int = 1_000_000, test_fraction: float = 0.1,
              split_seed: int = 0, root: Path | None = None, **_: object) -> Split:
    """About `text_bytes` of training text and `test_fraction` as much of validation text."""
    if seq_len < 1 or text_bytes < 1:
        raise UserError("data.seq_len and data.text_bytes must be positive")
    budget = {"train": text_bytes, "test": max(seq_len + 1, int(text_bytes * test_fraction))}
    parts: dict[str, list[bytes]] = {"train": [], "test": []}
    held = {"train": 0, "test": 0}
    cut = int(test_fraction * 1000)
    root = stdlib_root() if root is None else root
    for _, path in stdlib_files(root):
        held_out = zlib.crc32(str(path.relative_to(root)).encode(), split_seed) % 1000 < cut
        side = "test" if held_out else "train"
        if held[side] >= budget[side]:
            if all(held[s] >= budget[s] for s in held):
                break
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        data = data[: budget[side] - held[side]]
        parts[side].append(data)
        held[side] += len(data)
    x_train, y_train = windows(b"".join(parts["train"]), seq_len)
    x_test, y_test = windows(b"".join(parts["test"]), seq_len, "validation")
    return Split(x_train, y_train, x_test, y_test, n_classes=VOCAB)


def unigram_loss(split: Split) -> float:
    """Validation cross-entropy (nats per byte) of the training set's byte frequencies: the bar
    a language model must get under to have learned anything beyond single-byte statistics."""
    counts = torch.bincount(split.y_train.flatten(), minlength=VOCAB).double() + 1.0  # add-one smoothing
    logp = (counts / counts.sum()).log()
    return float(-logp[split.y_test.flatten()].mean())


__all__ = ["VOCAB", "load_text", "stdlib_files", "unigram_loss", "windows"]
