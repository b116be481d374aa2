"""How much gradient synchronization a data-parallel scheduler leaves exposed after compute (pure).

Every function takes the backward pass as the engine sees it: `layers` in forward order, each with
its backward seconds, its forward seconds and its gradient bytes. Backward runs the layers in
reverse; a layer's gradients are ready when its backward ends. What is returned is the time the
step spends past its own compute because of communication.

- fifo: nothing launches while backward runs (comm/policies.py FifoScheduler), so every byte is
  exposed.
- wait_free: gradients are packed into buckets in backward order (a small first bucket, then
  `bucket_bytes` each; data_parallel/bucket.py), and each bucket is sent when it is full and the
  link is free (wait-free back-propagation, Zhang et al. 2017, "Poseidon"). Exposed is what is
  still in flight when backward ends.
- priority: tensors are cut into `partition_bytes` pieces and the link always takes the ready piece
  that the next forward needs first (ByteScheduler, Peng et al. SOSP 2019; P3, Jayarajan et al.
  2019). The next forward starts layer by layer as its pieces arrive, so communication also hides
  behind the next step's forward.
- one_step_delay: step t's synchronization runs during step t+1's forward and backward
  (OD-SGD); only what exceeds that window is exposed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerTimes:
    fwd_s: float  # forward seconds of this layer (one step, all micro-batches)
    bwd_s: float  # backward seconds
    grad_bytes: float  # gradient bytes this layer contributes to the synchronization


SendTime = Callable[[float], float]  # seconds to synchronize one message of so many bytes


def _ready_times(layers: Sequence[LayerTimes]) -> list[float]:
    """When each layer's gradient is ready, counted from the start of backward (index = forward order)."""
    ready, clock = [0.0] * len(layers), 0.0
    for i in range(len(layers) - 1, -1, -1):
        clock += layers[i].bwd_s
        ready[i] = clock
    return ready


def fifo_exposed(layers: Sequence[LayerTimes], send: SendTime, bucket_bytes: float) -> float:
    """All buckets after backward, back to back."""
    return sum(send(b) for b in _buckets_of(sum(layer.grad_bytes for layer in layers), bucket_bytes))


def _buckets_of(total: float, bucket_bytes: float) -> list[float]:
    if total <= 0:
        return []
    n = max(1, math.ceil(total / bucket_bytes))
    return [total / n] * n


def wait_free_exposed(layers: Sequence[LayerTimes], send: SendTime, bucket_bytes: float,
                      first_bucket_bytes: float) -> float:
    """Buckets fill in backward order and go as soon as full (and the link is free)."""
    ready = _ready_times(layers)
    backward = ready[0] if layers else 0.0
    link_free, filled, limit = 0.0, 0.0, first_bucket_bytes
    for i in range(len(layers) - 1, -1, -1):
        filled += layers[i].grad_bytes
        if limit > 0 and filled >= limit:  # the first full bucket leaves when this layer is ready
            link_free = max(link_free, ready[i]) + send(limit)
            filled -= limit
            limit = bucket_bytes
            full = math.floor(filled / limit)  # any further full ones follow back to back
            link_free += full * send(limit)
            filled -= full * limit
    if filled > 0:
        link_free = max(link_free, backward) + send(filled)
    return max(0.0, link_free - backward)


def priority_exposed(layers: Sequence[LayerTimes], send: SendTime, partition_bytes: float,
                     max_pieces: int = 4096, in_flight: int = 1) -> float:
    """Pieces by next-forward order; the next forward waits layer by layer for its own pieces.

    Layers become ready last to first, so the ready piece the next forward needs first is always
    one of the layer that became ready most recently: a heap on layer index runs the policy.
    Pieces are coarsened to at most `max_pieces` per step (a 175B model at 2 MB would be 10^5).
    With `in_flight` >= 2 pieces allowed on the link at once (the engine's credit window), a piece
    that follows another back to back pays only the larger of its latency and its transfer
    (`send(0)` and `send(s) - send(0)`): its start-up overlaps the previous piece's bytes (the
    gap of LogP, Culler et al. 1993), where one at a time pays both.
    """
    ready = _ready_times(layers)
    backward = ready[0] if layers else 0.0
    total = sum(layer.grad_bytes for layer in layers)
    piece = max(partition_bytes, total / max_pieces) if total > 0 else partition_bytes
    left = [max(1, math.ceil(layer.grad_bytes / piece)) if layer.grad_bytes > 0 else 0 for layer in layers]
    size = [layer.grad_bytes / n if n else 0.0 for layer, n in zip(layers, left, strict=True)]
    done = [0.0] * len(layers)  # when each layer's last piece has arrived
    heap: list[int] = []
    upcoming = [i for i in range(len(layers) - 1, -1, -1) if left[i]]  # in ready order
    clock, nxt, latency, busy = 0.0, 0, send(0.0), False
    while nxt < len(upcoming) or heap:
        if not heap:
            busy = busy and clock >= ready[upcoming[nxt]]  # the link went idle: the next piece starts afresh
            clock = max(clock, ready[upcoming[nxt]])
        while nxt < len(upcoming) and ready[upcoming[nxt]] <= clock:
            heapq.heappush(heap, upcoming[nxt])
            nxt += 1
        i = heap[0]
        # send this layer's pieces until the next layer becomes ready (it would take the link next)
        until = ready[upcoming[nxt]] if nxt < len(upcoming) else math.inf
        while left[i] and clock < until:
            clock += send(size[i]) if not busy or in_flight < 2 else max(latency, send(size[i]) - latency)
            busy = True
            left[i] -= 1
        done[i] = clock
        if not left[i]:
            heapq.heappop(heap)
    clock = backward  # the next forward: a layer starts when the previous one ends and its weights are in
    for i, layer in enumerate(layers):
        clock = max(clock, done[i]) + layer.fwd_s
    forward = sum(layer.fwd_s for layer in layers)
    return max(0.0, clock - backward - forward)


def piece_count(layers: Sequence[LayerTimes], partition_bytes: float) -> int:
    """Pieces the priority scheduler sends a step: gradients gathered in backward order until they
    hold a partition, then cut into partitions (data_parallel/layout.py `assign_buckets` with
    the partition as both caps, then `cut_pieces`), here at the granularity of layers."""
    pieces, filled = 0, 0.0
    for layer in reversed(layers):
        filled += layer.grad_bytes
        if filled >= partition_bytes:
            pieces, filled = pieces + math.ceil(filled / partition_bytes), 0.0
    return pieces + (filled > 0)


def one_step_delay_exposed(layers: Sequence[LayerTimes], send: SendTime, bucket_bytes: float) -> float:
    """The whole synchronization hides behind the next step's compute, as far as that lasts."""
    window = sum(layer.fwd_s + layer.bwd_s for layer in layers)
    return max(0.0, fifo_exposed(layers, send, bucket_bytes) - window)


def total_comm(layers: Sequence[LayerTimes], send: SendTime, bucket_bytes: float) -> float:
    """Seconds on the link per step, whether exposed or hidden."""
    return fifo_exposed(layers, send, bucket_bytes)
