"""Trust ratios over whole tensors when ranks hold blocks of a flat buffer (ZeRO) or slices (tp)."""

import optim_reference as ref
import pytest
import torch
import torch.distributed as dist
from distributed import run_workers

from paraloom.optim import LAMB, LARS

STEPS = 4
SETTINGS = {"lars": dict(lr=2.0, momentum=0.9, eta=0.02, weight_decay=0.01),
            "lamb": dict(lr=0.05, weight_decay=0.01)}
OPTIMIZERS = {"lars": LARS, "lamb": LAMB}
REFERENCES = {"lars": ref.lars, "lamb": ref.lamb}

# an optimizer's first add_param_group imports torch._dynamo (~0.5 s): once here, not in every forked rank
LAMB([torch.zeros(1, requires_grad=True)])


def _flat(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """The tensors' concatenation, zero-padded to a multiple of `world_size` (as shard.py pads a bucket)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return torch.cat([flat, flat.new_zeros(-flat.numel() % world_size)])


def _segment_ids(world_size: int) -> tuple[torch.Tensor, int]:
    """Each flat element's tensor index; padding gets a segment of its own (its ratio does not matter)."""
    sizes = torch.tensor([t.numel() for t in ref.make_tensors()])
    ids = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    padded = torch.cat([ids, ids.new_full((-ids.numel() % world_size,), len(sizes))])
    return padded, len(sizes) + 1


def _sharded(rank: int, world_size: int, name: str, group_kind: str) -> torch.Tensor:
    flat = _flat(ref.make_tensors(), world_size)
    block = flat.numel() // world_size
    mine = slice(rank * block, (rank + 1) * block)
    shard = torch.nn.Parameter(flat[mine].clone())
    opt = OPTIMIZERS[name]([shard], **SETTINGS[name])
    ids, n_segments = _segment_ids(world_size)
    group = dist.group.WORLD if group_kind == "world" else dist.new_group(list(range(world_size)))
    opt.set_segments(shard, ids[mine], n_segments, group)
    for step_noise in ref.noise(STEPS):
        shard.grad = ref.grad(shard.detach(), _flat(step_noise, world_size)[mine])
        opt.step()
    return shard.detach()


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_blocks_of_a_flat_buffer_step_like_the_whole_tensors(world_size, name):
    ends = set(torch.tensor([t.numel() for t in ref.make_tensors()]).cumsum(0).tolist())
    block = _flat(ref.make_tensors(), world_size).numel() // world_size
    assert world_size == 1 or any(r * block not in ends for r in range(1, world_size))  # cuts a tensor
    blocks = run_workers(_sharded, world_size, name, "world" if world_size != 3 else "new_group")
    expected = REFERENCES[name](ref.make_tensors(), ref.noise(STEPS), **SETTINGS[name])
    total = sum(t.numel() for t in expected)
    torch.testing.assert_close(torch.cat(blocks)[:total], _flat(expected, 1))
    assert not torch.cat(blocks)[total:].any()  # padding stays zero


def _tensor_parallel(rank: int, world_size: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    weight, bias = ref.make_tensors()[2], ref.make_tensors()[4]  # (4, 4) split by columns; (4,) whole
    piece = torch.nn.Parameter(weight.tensor_split(world_size, dim=1)[rank].clone())
    whole = torch.nn.Parameter(bias.clone())
    opt = OPTIMIZERS[name]([piece, whole], **SETTINGS[name])
    opt.set_segments(piece, None, 1, dist.new_group(list(range(world_size))))
    for step_noise in ref.noise(STEPS):
        piece.grad = ref.grad(piece.detach(), step_noise[2].tensor_split(world_size, dim=1)[rank])
        whole.grad = ref.grad(whole.detach(), step_noise[4])
        opt.step()
    return piece.detach(), whole.detach()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_a_tensor_parallel_slice_is_one_segment_over_its_group(world_size, name):
    out = run_workers(_tensor_parallel, world_size, name)
    tensors = ref.make_tensors()
    expected = REFERENCES[name]([tensors[2], tensors[4]], [[n[2], n[4]] for n in ref.noise(STEPS)],
                                **SETTINGS[name])
    torch.testing.assert_close(torch.cat([piece for piece, _ in out], dim=1), expected[0])
    for _, whole in out:
        torch.testing.assert_close(whole, expected[1])


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_local_segments_need_no_process_group(name):
    flat = torch.nn.Parameter(_flat(ref.make_tensors(), 1))
    opt = OPTIMIZERS[name]([flat], **SETTINGS[name])
    ids, n_segments = _segment_ids(1)
    opt.set_segments(flat, ids, n_segments)  # group None: the whole tensors are all here
    for step_noise in ref.noise(STEPS):
        flat.grad = ref.grad(flat.detach(), _flat(step_noise, 1))
        opt.step()
    expected = REFERENCES[name](ref.make_tensors(), ref.noise(STEPS), **SETTINGS[name])
    torch.testing.assert_close(flat.detach(), _flat(expected, 1))


def test_set_segments_checks_its_arguments_and_can_be_undone():
    p, other = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = LAMB([p])
    with pytest.raises(ValueError, match="not a parameter"):
        opt.set_segments(other, torch.zeros(4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="3 segment ids"):
        opt.set_segments(p, torch.zeros(3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        opt.set_segments(p, torch.tensor([0, 1, 2, 0]), 2)
    with pytest.raises(ValueError, match="one segment"):
        opt.set_segments(p, None, 2)
    opt.set_segments(p, torch.tensor([0, 0, 1, 1]), 2)
    assert p in opt._segments
    opt.set_segments(p)
    assert p not in opt._segments
