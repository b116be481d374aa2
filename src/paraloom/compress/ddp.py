"""A torch DDP communication hook that averages gradient buckets through paraloom's compressors."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paraloom.compress.base import COMPRESSORS, make_compressor
from paraloom.compress.powersgd import PowerSGDState
from paraloom.config.errors import UserError

# torch 2.13 renamed the flat all-gather; older releases (>= 2.4) have only the second name
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_STOP = object()


def hook_names() -> list[str]:
    """Every name `ddp_hook` accepts: "none", "powersgd" and the registered compressors."""
    return ["none", "powersgd", *sorted(COMPRESSORS)]


class CompressionHookState:
    """What the hook needs between calls: the group, the compressor, the wire stats and the issuing thread.

    Ordering (DESIGN.md §3): DDP calls the hook once per bucket, in bucket order, on every rank. The
    hook only enqueues the bucket; one daemon thread owned by this object takes buckets first in,
    first out, and is the only thread that issues the hook's collectives. It compresses, runs the
    collectives one after another (blocking), decodes, and completes the future the hook returned.
    No collective is ever launched from a future callback, so every rank issues the same sequence.

    Keys: the compressor is keyed per bucket *layout* (its parameters, in order). The first layout
    seen at bucket index i gets key i, so keys are bucket indices until DDP rebuilds its buckets
    after the first step (it starts with one bucket of every parameter); a changed layout then gets
    a fresh key, and error-feedback memory never meets a bucket of another size. PowerSGD is keyed
    per parameter (numbered in first-seen order), which survives the rebuild. Both numberings depend
    only on the order DDP presents buckets, so every rank derives the same keys.

    `bytes` counts the payload bytes this rank handed to its collectives, `calls` the collectives.
    """

    def __init__(self, name: str, compressor: Any = None, powersgd: PowerSGDState | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.name = name
        self.compressor = compressor
        self.powersgd = powersgd
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.bytes = 0
        self.calls = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._param_keys: dict[int, int] = {}  # id(parameter) -> key, in first-seen order
        self._params: list[torch.Tensor] = []  # keeps those ids from being reused
        self._layout_keys: dict[tuple[int, ...], int] = {}  # bucket layout (parameter keys) -> key

    # ---- hook side (DDP's calling thread) ------------------------------------------------------------

    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Queue one bucket's reduction; the returned future gets its average over ranks."""
        if self._closed:
            raise RuntimeError("this DDP compression hook state was closed")
        buffer = bucket.buffer()
        params = list(bucket.parameters())
        param_keys = tuple(self._param_key(p) for p in params)
        if self.name == "powersgd":
            job = self._powersgd_job(buffer, params, param_keys)
        elif self.name == "none":
            job = self._plain_job(buffer)
        else:
            key = self._bucket_key(bucket.index(), param_keys)
            make = self._summed_job if self.compressor.summable else self._gathered_job
            job = make(buffer, key)
        future: torch.futures.Future = torch.futures.Future()
        self._start()
        self._queue.put((job, future))
        if bucket.is_last() and self.powersgd is not None:
            self._queue.put((self.powersgd.next_iteration, None))  # runs after this step's last bucket
        return future

    def close(self) -> None:
        """Stop the issuing thread once it has finished what was queued."""
        self._closed = True
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            # OpenMP's thread count is per thread: a new thread would not see torch.set_num_threads
            self._thread = threading.Thread(target=self._run, args=(torch.get_num_threads(),),
                                            name="paraloom-ddp-hook", daemon=True)
            self._thread.start()

    def _param_key(self, param: torch.Tensor) -> int:
        key = self._param_keys.get(id(param))
        if key is None:
            key = self._param_keys[id(param)] = len(self._params)
            self._params.append(param)
        return key

    def _bucket_key(self, index: int, layout: tuple[int, ...]) -> int:
        """The bucket index for a layout first seen there, else one past the largest key so far."""
        key = self._layout_keys.get(layout)
        if key is None:
            used = set(self._layout_keys.values())
            key = self._layout_keys[layout] = index if index not in used else max(used) + 1
        return key

    # ---- issuing thread --------------------------------------------------------------------------------

    def _run(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, future = item
            if self._failure is not None:  # a failed collective leaves the ranks out of step: stop here
                if future is not None:
                    future.set_exception(RuntimeError(f"an earlier bucket failed: {self._failure!r}"))
                continue
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - it must reach DDP through the future
                self._failure = exc
                if future is not None:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        self._count(tensor)
        dist.all_reduce(tensor, group=self.process_group)

    def _all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        gathered = payload.new_empty(self.world_size * payload.numel())
        self._count(payload)
        _all_gather_flat(gathered, payload, group=self.process_group)
        return gathered.view(self.world_size, -1)

    def _count(self, tensor: torch.Tensor) -> None:
        self.bytes += tensor.numel() * tensor.element_size()
        self.calls += 1

    def _plain_job(self, buffer: torch.Tensor) -> Callable[[], torch.Tensor]:
        def job() -> torch.Tensor:
            self._all_reduce(buffer)
            return buffer.div_(self.world_size)
        return job

    def _summed_job(self, buffer: torch.Tensor, key: int) -> Callable[[], torch.Tensor]:
        def job() -> torch.Tensor:
            payload, ctx = self.compressor.compress(buffer, key)
            self._all_reduce(payload)
            buffer.copy_(self.compressor.decompress(payload, ctx).view_as(buffer))
            return buffer.div_(self.world_size)
        return job

    def _gathered_job(self, buffer: torch.Tensor, key: int) -> Callable[[], torch.Tensor]:
        def job() -> torch.Tensor:
            payload, ctx = self.compressor.compress(buffer, key)
            chunks = self._all_gather(payload.contiguous().view(-1))
            total = torch.zeros_like(buffer)
            for chunk in chunks:  # rank order on every rank, so every rank gets the same sum
                total += self.compressor.decompress(chunk, ctx).reshape(buffer.shape)
            return buffer.copy_(total).div_(self.world_size)
        return job

    def _powersgd_job(self, buffer: torch.Tensor, params: list[torch.Tensor],
                      keys: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        """Per matrix: the bucket's parameters' gradients are views of the flat buffer, in order."""
        sizes = [p.numel() for p in params]
        if sum(sizes) != buffer.numel():
            raise RuntimeError(f"bucket of {buffer.numel()} elements holds parameters of {sum(sizes)}")
        grads = [piece.view(p.shape) for piece, p in zip(buffer.split(sizes), params, strict=True)]
        state = self.powersgd

        def job() -> torch.Tensor:
            # decided on this thread, after the previous step's next_iteration(): the same on every rank
            flags = [state.should_compress(g.shape) for g in grads]
            if not any(flags):
                self._all_reduce(buffer)
                return buffer.div_(self.world_size)
            plain = [g for g, flag in zip(grads, flags, strict=True) if not flag]
            packed = [(k, g) for k, g, flag in zip(keys, grads, flags, strict=True) if flag]
            if plain:
                for g, summed in zip(plain, self._all_reduce_list(plain), strict=True):
                    g.copy_(summed)
            ps = self._all_reduce_list([state.p_matrices(k, g) for k, g in packed])
            qs = self._all_reduce_list([state.q_matrices(k, p) for (k, _), p in zip(packed, ps, strict=True)])
            for (k, g), q in zip(packed, qs, strict=True):
                state.decompress(k, q, out=g)
            return buffer.div_(self.world_size)
        return job

    def _all_reduce_list(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum several tensors over ranks in one all-reduce of their concatenation; views of the result."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._all_reduce(flat)
        pieces = flat.split([t.numel() for t in tensors])
        return [piece.view(t.shape) for piece, t in zip(pieces, tensors, strict=True)]


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The DDP comm hook: hand the bucket to `state`'s issuing thread, return the future of its average."""
    return state.submit(bucket)


# DDP compares these annotations with the real objects; postponed evaluation would leave strings
compression_hook.__annotations__ = {"state": CompressionHookState, "bucket": dist.GradBucket,
                                    "return": torch.futures.Future[torch.Tensor]}


def ddp_hook(name: str, **options: Any) -> tuple[CompressionHookState, Callable]:
    """`(state, hook)` for `ddp_model.register_comm_hook(state, hook)`: DDP's buckets are averaged
    over ranks through compressor `name` ("none" for a plain all-reduce, "powersgd" for
    `PowerSGDState(**options)`, else `make_compressor(name, **options)`). `process_group=` picks
    the group (default: WORLD). Call `state.close()` when done to stop its issuing thread."""
    process_group = options.pop("process_group", None)
    if name == "none":
        if options:
            raise UserError(f"ddp_hook('none') takes no options, got {sorted(options)}")
        state = CompressionHookState(name, process_group=process_group)
    elif name == "powersgd":
        state = CompressionHookState(name, powersgd=PowerSGDState(**options), process_group=process_group)
    elif name in COMPRESSORS:
        state = CompressionHookState(name, make_compressor(name, **options), process_group=process_group)
    else:
        raise UserError(f"ddp_hook name={name!r} is not known; choose one of: {', '.join(hook_names())}")
    return state, compression_hook
