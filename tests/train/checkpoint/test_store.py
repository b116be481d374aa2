"""Checkpoint files: atomic folders with checksums, keep-last-k, damaged ones passed over by name, crafted
ones refused in one line."""

import hashlib
import io
import json
import pickle
import time
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from paraloom.comm.objects import broadcast_text
from paraloom.config.errors import UserError
from paraloom.train.checkpoint.store import (
    agree_on_checkpoint,
    latest_valid,
    load_checkpoint,
    save_checkpoint,
    step_dir,
    verify,
)


def _save_steps(rank, world, run_dir, steps, keep):
    for step in steps:
        local = {"rank": rank, "step": step, "value": torch.full((5,), float(rank * 100 + step))}
        shared = {"model": torch.arange(4.0) + step} if rank == 0 else None
        save_checkpoint(run_dir, step, local=local, shared=shared, keep=keep)
    return agree_on_checkpoint(run_dir)


def test_saved_folders_are_whole_and_pruned(tmp_path):
    chosen = run_workers(_save_steps, 2, tmp_path, [10, 20, 30, 40], 3)
    assert chosen == [(40, 2, True), (40, 2, True)]
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["step-00000020", "step-00000030", "step-00000040"]  # keep 3, no .tmp left
    manifest = json.loads((step_dir(tmp_path, 40) / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["format"] == "dcp"
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "objects-rank0.pt",
                                      "objects-rank1.pt"}
    shared, local = load_checkpoint(tmp_path, 40, 1, torch.device("cpu"))
    assert torch.equal(shared["model"], torch.arange(4.0) + 40)
    assert local["rank"] == 1 and torch.equal(local["value"], torch.full((5,), 140.0))


def test_truncated_latest_is_passed_over_with_its_name(tmp_path, capsys):
    run_workers(_save_steps, 2, tmp_path, [10, 20], 3)
    damaged = step_dir(tmp_path, 20) / "__1_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-7])
    assert "__1_0.distcp does not match its checksum" in verify(step_dir(tmp_path, 20))
    assert latest_valid(tmp_path, quiet=True) == step_dir(tmp_path, 10)  # a first look says nothing
    assert "skipping" not in capsys.readouterr().err
    assert latest_valid(tmp_path) == step_dir(tmp_path, 10)
    assert "skipping checkpoint step-00000020" in capsys.readouterr().err
    # a flipped byte (same size) is caught as well; a half-written folder is never considered
    shared = step_dir(tmp_path, 10) / "objects-rank0.pt"
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    (tmp_path / "checkpoints" / "step-00000030.tmp").mkdir()
    assert latest_valid(tmp_path) is None


def test_missing_manifest_and_other_world_size(tmp_path):
    run_workers(_save_steps, 2, tmp_path, [10, 20], 3)
    (step_dir(tmp_path, 20) / "manifest.json").unlink()
    assert "manifest.json is missing" in verify(step_dir(tmp_path, 20))
    assert latest_valid(tmp_path) == step_dir(tmp_path, 10)


def _save_async(rank, world, run_dir):
    group = torch.distributed.new_group(backend="gloo")
    value = torch.full((1000,), float(rank))
    pending = []
    for step in (10, 20):
        shared = {"model": torch.arange(4.0) + step} if rank == 0 else None
        pending.append(save_checkpoint(run_dir, step, local={"value": value}, shared=shared, keep=3,
                                       async_group=group))
        value.add_(1000)  # training goes on at once: the checkpoint holds the values at the save
        pending[-1].wait()
    torch.distributed.barrier()
    return agree_on_checkpoint(run_dir)


def test_asynchronous_saves_hold_the_values_at_the_save_and_are_sealed_whole(tmp_path):
    assert run_workers(_save_async, 2, tmp_path) == [(20, 2, True), (20, 2, True)]
    for step, added in ((10, 0), (20, 1000)):
        assert verify(step_dir(tmp_path, step)) is None
        for rank in (0, 1):
            shared, local = load_checkpoint(tmp_path, step, rank, torch.device("cpu"))
            assert torch.equal(local["value"], torch.full((1000,), float(rank + added)))
            assert torch.equal(shared["model"], torch.arange(4.0) + step)


class _Trap:
    """Unpickling it touches a file: proof that a tampered checkpoint file was read."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_tampered_dcp_metadata_is_never_unpickled(tmp_path):
    run_workers(_save_steps, 2, tmp_path, [10, 20], 3)
    marker = tmp_path / "unpickled"
    (step_dir(tmp_path, 20) / ".metadata").write_bytes(pickle.dumps(_Trap(str(marker))))
    # passed over, the step before taken
    assert run_workers(_agree, 2, tmp_path) == [(10, 2, True), (10, 2, True)]
    assert not marker.exists()
    shared, local = load_checkpoint(tmp_path, 10, 0, torch.device("cpu"))
    assert torch.equal(shared["model"], torch.arange(4.0) + 10) and local["step"] == 10
    assert not marker.exists()


def _agree(rank, world, run_dir):
    return agree_on_checkpoint(run_dir)


def _texts(rank, world, text):
    return broadcast_text(text if rank == 0 else "ignored"), broadcast_text(None)


def test_broadcast_text_sends_rank_zeros_string():
    out = run_workers(_texts, 3, "/runs/ünïcode path")
    assert out == [("/runs/ünïcode path", None)] * 3


def _save_genuine(rank, world, run_dir, state):
    save_checkpoint(run_dir, 10, local=state["local"], shared=state["shared"], keep=3)


def _reseal(folder, name, data):
    """Write `data` as the checkpoint's file `name` and its checksum into the manifest, as a forger would."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert verify(folder) is None  # the checksums match: only the allow-list stands in the way


def _with_bytes_entry(metadata):
    """A genuine `.metadata` whose first entry says "bytes": DCP torch.loads those with weights_only=False."""
    fqn = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    return metadata


def _outside(metadata):
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../step-00000009/__0_0.distcp"
    return metadata


CRAFTED = {  # file, what it becomes (given the genuine `.metadata` and a marker path), what the error names
    "trap": (".metadata", lambda md, marker: _Trap(marker), "names pathlib.Path.touch, which"),
    "trap inside": (".metadata", lambda md, marker: (setattr(md, "version", _Trap(marker)), md)[1],
                    "names pathlib.Path.touch, which"),
    "bytes entry": (".metadata", lambda md, marker: _with_bytes_entry(md),
                    "names torch.distributed.checkpoint.metadata.BytesStorageMetadata, which"),
    "outside": (".metadata", lambda md, marker: _outside(md), "points at '../step-00000009/__0_0.distcp'"),
    "not metadata": (".metadata", lambda md, marker: [1, 2], "holds a list, not DCP metadata"),
    "objects": ("objects-rank0.pt", None, "names getattr, which torch.load(weights_only=True) refuses"),
}


def test_a_genuine_checkpoint_loads_bitwise_and_crafted_files_are_refused_in_one_line(tmp_path):
    generator = torch.Generator().manual_seed(0)
    state = {"local": {"step": 10, "w": torch.randn(7, 3, generator=generator).to(torch.bfloat16),
                       "ids": torch.randint(-2**62, 2**62, (5,), generator=generator), "lr": 0.1},
             "shared": {"model": {"fc.weight": torch.randn(4, 4, generator=generator)},
                        "n": torch.tensor(3.0)}}
    run_workers(_save_genuine, 1, tmp_path, state)
    folder = step_dir(tmp_path, 10)
    shared, local = load_checkpoint(tmp_path, 10, 0, torch.device("cpu"))
    assert local["step"] == 10 and local["lr"] == 0.1 and local["w"].dtype == torch.bfloat16
    for got, want in ((local["w"], state["local"]["w"]), (local["ids"], state["local"]["ids"]),
                      (shared["model"]["fc.weight"], state["shared"]["model"]["fc.weight"]),
                      (shared["n"], state["shared"]["n"])):
        assert torch.equal(got, want) and got.dtype == want.dtype
    genuine = {name: (folder / name).read_bytes() for name in (".metadata", "objects-rank0.pt")}
    marker = tmp_path / "unpickled"
    for case, (name, make, says) in CRAFTED.items():
        if make is None:
            buffer = io.BytesIO()
            torch.save({"local": _Trap(str(marker)), "shared": None}, buffer)
            data = buffer.getvalue()
        else:
            data = pickle.dumps(make(pickle.loads(genuine[".metadata"]), str(marker)))
        _reseal(folder, name, data)
        started = time.perf_counter()
        with pytest.raises(UserError) as refused:
            load_checkpoint(tmp_path, 10, 0, torch.device("cpu"))
        message = str(refused.value)
        assert says in message and str(folder / name) in message and "\n" not in message, (case, message)
        assert time.perf_counter() - started < 1 and not marker.exists(), case
        _reseal(folder, name, genuine[name])
    shared, local = load_checkpoint(tmp_path, 10, 0, torch.device("cpu"))  # the genuine files load again
    assert torch.equal(local["w"], state["local"]["w"])
