"""Optimizer-state sharding (ZeRO stages 1-2 style): reduce-scatter gradients, step a shard, all-gather.

Every bucket is padded to a multiple of the world size and cut into one equal block per rank.
During backward each ready bucket's gradients are reduce-scattered, so a rank receives only the
sum for its own block. `step(optimizer)` averages that block, steps it with an optimizer of the
user's kind and hyper-parameters that holds state for the block alone (so optimizer memory per
rank is ~1/N), and all-gathers the updated blocks into the flat parameter buffers. The user's
optimizer keeps no state; its learning rate and other hyper-parameters are read every step, so
learning-rate schedules on it still apply.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import empty as dtensor_empty

from paraloom.comm.algorithms import reduce_scatter
from paraloom.config.errors import UserError
from paraloom.data_parallel.synchronous import SyncUpdater
from paraloom.optim.trust import TrustRatioOptimizer

# torch 2.13 renamed the flat collectives; older releases (>= 2.4) have only the second names
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedUpdater(SyncUpdater):
    guards_on_sums = False  # see SyncUpdater: it does not update from this step's averaged gradients
    plain_optimizer_step = False  # see SyncUpdater: DistributedOptimizer (or engine.step) drives it

    def __init__(self, engine, layout) -> None:
        super().__init__(engine)
        n, rank = engine.world_size, engine.rank
        self.shards: list[torch.Tensor] = []  # this rank's block of each bucket's parameters
        for bucket in layout.buckets:
            bucket.flatten_params()
            shard = torch.nn.Parameter(bucket.param_buffer.view(n, -1)[rank].clone())
            shard.grad = torch.zeros_like(shard)
            self.shards.append(shard)
        self.inner: torch.optim.Optimizer | None = None
        self._mesh: DeviceMesh | None = None

    def check_classic(self) -> None:
        raise RuntimeError("comm.shard_optimizer=true updates in engine.step(optimizer); "
                           "sync_gradients() does not apply")

    def launch(self, piece, on_done=None):
        engine, bucket = self.engine, piece.bucket
        shard_grad = self.shards[bucket.index].grad
        if engine.algorithm == "native":
            native = lambda: _reduce_scatter_flat(shard_grad, bucket.buffer, group=engine.group,  # noqa: E731
                                                  async_op=True)
        else:
            native = None

        def blocking():
            shard_grad.copy_(reduce_scatter(bucket.buffer, algorithm="ring", group=engine.group))

        name = engine.piece_name(piece) + " (reduce-scatter)"
        return engine.run_async(name, bucket.nbytes, native, blocking, on_done)

    def _inner_for(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if len(optimizer.param_groups) != 1:
            raise UserError("comm.shard_optimizer=true supports an optimizer with one parameter group")
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        if self.inner is None:
            # the group holds keys the constructor does not take (AdamW's decoupled_weight_decay):
            # build with those it takes, then carry every key over
            accepted = inspect.signature(type(optimizer).__init__).parameters
            self.inner = type(optimizer)(self.shards, **{k: v for k, v in hyper.items() if k in accepted})
            self.inner.param_groups[0].update(hyper)
            # the user's step pre-hooks (unscaling, clipping: paraloom's recipe) act on the shards,
            # whose norms sum over the ranks holding the other blocks
            self.inner.partition_group = self.engine.group
            for hook in getattr(optimizer, "_optimizer_step_pre_hooks", {}).values():
                self.inner.register_step_pre_hook(hook)
            if isinstance(self.inner, TrustRatioOptimizer):
                self._segment_shards(self.inner)
            saved, self._saved_inner = getattr(self, "_saved_inner", None), None
            if saved is not None:
                self.inner.load_state_dict(saved)
        else:
            self.inner.param_groups[0].update(hyper)
        return self.inner

    def _segment_shards(self, inner: TrustRatioOptimizer) -> None:
        """LARS / LAMB: a shard is a block of a flat buffer of several tensors, and a tensor may
        straddle two ranks' blocks; each element's trust ratio is its whole tensor's (segment i:
        the bucket's parameter i; the padding, a segment of its own), norms summed over the group."""
        engine = self.engine
        n, rank = engine.world_size, engine.rank
        group = engine.group if n > 1 else None
        for bucket, shard in zip(engine.buckets, self.shards, strict=True):
            ids = torch.full((bucket.buffer.numel(),), len(bucket.params), dtype=torch.long)
            for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
                ids[offset:offset + p.numel()] = i
            inner.set_segments(shard, ids.view(n, -1)[rank].to(shard.device), len(bucket.params) + 1, group)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        engine = self.engine
        inner = self._inner_for(optimizer)
        if engine.world_size == 1:
            for bucket, shard in zip(engine.buckets, self.shards, strict=True):
                shard.grad.copy_(bucket.buffer)
        engine.complete_missing()
        engine.executor.wait_all(engine.n_pieces)
        engine.reset_comm()
        for shard in self.shards:
            if engine.world_size > 1:
                shard.grad.div_(engine.world_size)
        inner.step()
        works = []
        for bucket, shard in zip(engine.buckets, self.shards, strict=True):
            if engine.world_size == 1:
                bucket.param_buffer.copy_(shard)
                continue
            works.append(engine.run_async(
                f"bucket {bucket.index} (all-gather)", bucket.nbytes,
                lambda b=bucket, s=shard: _all_gather_flat(b.param_buffer, s, group=engine.group,
                                                           async_op=True),
                lambda b=bucket, s=shard: _all_gather_blocking(b.param_buffer, s, engine.group)))
        for work in works:
            work.wait()
        engine.zero_grad()

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state. Every tensor of a shard's length is a DTensor: the
        shard's block of its bucket's unpadded flat state, so a checkpoint reshards to any size."""
        if self.inner is None:
            return {"inner": None}
        state = self.inner.state_dict()
        mesh = self.mesh()
        for i, live in state["state"].items():
            size, values = self.unpadded(i), dict(live)  # the optimizer's own dicts stay as they are
            state["state"][i] = values
            for key, value in live.items():
                if torch.is_tensor(value) and value.shape == self.shards[i].shape:
                    begin = min(size, self.engine.rank * value.numel())
                    local = value[:max(0, min(value.numel(), size - begin))]
                    values[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                     shape=(size,), stride=(1,))
        return {"inner": state}

    def unpadded(self, i: int) -> int:
        """Elements of bucket i's parameters, without the padding to a multiple of the world size."""
        return sum(p.numel() for p in self.engine.buckets[i].params)

    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            device = self.shards[0].device.type if self.shards else "cpu"
            self._mesh = DeviceMesh.from_group(self.engine.group or dist.group.WORLD, device)
        return self._mesh

    def sharded_target(self, shape: list[int], dtype: torch.dtype) -> DTensor:
        """An empty DTensor of this world's layout, for a checkpoint's sharded state to load into."""
        return dtensor_empty(*shape, dtype=dtype, device_mesh=self.mesh(), placements=[Shard(0)])

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Call after the model's parameters are loaded: the shards are taken from them again."""
        n, rank = self.engine.world_size, self.engine.rank
        for bucket, shard in zip(self.engine.buckets, self.shards, strict=True):
            shard.copy_(bucket.param_buffer.view(n, -1)[rank])
        inner = state["inner"]
        if inner is not None:
            for i, values in inner["state"].items():
                for key, value in list(values.items()):
                    if isinstance(value, DTensor):  # this rank's block, padded to the shard's length
                        padded = self.shards[i].new_zeros(self.shards[i].shape, dtype=value.dtype)
                        local = value.to_local()
                        padded[:local.numel()] = local
                        values[key] = padded
        self._saved_inner = inner  # loaded once step() has made the inner optimizer

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self.inner is None:
            return 0
        return sum(t.numel() * t.element_size() for state in self.inner.state.values()
                   for t in state.values() if torch.is_tensor(t))


def _all_gather_blocking(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    from paraloom.comm.algorithms import all_gather

    out.view(-1, shard.numel())[dist.get_rank(group)].copy_(shard)
    all_gather(out, algorithm="ring", group=group)
