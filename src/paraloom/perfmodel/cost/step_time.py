"""Step time and memory per device of one parallel plan, from a model profile and a hardware profile.

White box (Paleo, Qi et al. ICLR 2017: compute + data movement + communication, each from the
model's counts and the hardware's constants), with what paraloom runs on top: pipeline schedules,
tensor-parallel collectives, the data-parallel scheduler's overlap, compression, and the
parameter server's consistency modes. Every figure is for one step of `global_batch` samples.
"""

from __future__ import annotations

import functools
import operator

from paraloom.config.choices import FULLY_SHARDED
from paraloom.config.errors import UserError
from paraloom.perfmodel.cost import overlap
from paraloom.perfmodel.cost.compression import codec_time, compressed_bytes, compressed_sync_time
from paraloom.perfmodel.cost.cpu import (
    WIRE_DTYPE,
    arrival_seconds,
    comm_cpu,
    ps_slices,
    server_cpu,
    unhidden_cpu,
)
from paraloom.perfmodel.cost.device import layer_seconds, update_seconds
from paraloom.perfmodel.cost.links import dp_group, dp_link, stream
from paraloom.perfmodel.cost.memory import stage_peaks
from paraloom.perfmodel.cost.network import allreduce_time, group_allreduce_time, group_link, p2p_time
from paraloom.perfmodel.cost.ps_sync import ps_bsp_sync
from paraloom.perfmodel.cost.queueing import asp_cycle
from paraloom.perfmodel.cost.sharding import HOST_RATE, shard_group, sharded_sync
from paraloom.perfmodel.cost.storage import READ_BANDWIDTH, read_seconds
from paraloom.perfmodel.hardware import Hardware
from paraloom.perfmodel.model_profile import ModelProfile
from paraloom.perfmodel.plan import PIECE_OVERHEAD, PRIORITY_OVERHEAD, SYNC_OVERHEAD, Estimate, Options, Plan


def split_stages(profile: ModelProfile, pp: int, seconds: list[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges for `pp` stages that minimize the slowest stage's time.

    Bisection on the bound with a greedy fill (a bound is feasible if greedy needs at most pp
    stages), then stages are split further until there are exactly pp; O(n log) per plan.
    """
    n = len(profile.layers)
    if pp > n:
        raise UserError(f"pp={pp} stages need at least {pp} layers; {profile.spec!r} has {n}")

    def fill(bound: float) -> list[tuple[int, int]]:
        out, start, acc = [], 0, 0.0
        for i, s in enumerate(seconds):
            if i > start and acc + s > bound:
                out.append((start, i))
                start, acc = i, 0.0
            acc += s
        return [*out, (start, n)]

    if pp == 1:
        return [(0, n)]
    # the bound that surely fits, summed as `fill` sums (Python 3.12's sum() compensates its rounding,
    # and the whole could then come out a last bit below fill's running total: one stage too many)
    lo, hi = max(seconds), functools.reduce(operator.add, seconds, 0.0)
    for _ in range(60):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if len(fill(mid)) <= pp else (mid, hi)
    stages = fill(hi)
    while len(stages) < pp:  # split the slowest stage that has two layers or more
        k = max((k for k, (a, b) in enumerate(stages) if b - a > 1),
                key=lambda k: sum(seconds[stages[k][0]:stages[k][1]]))
        a, b = stages[k]
        cut = min(range(a + 1, b), key=lambda c: max(sum(seconds[a:c]), sum(seconds[c:b])))
        stages[k:k + 1] = [(a, cut), (cut, b)]
    return stages


def host_slowdown(hw: Hardware, plan: Plan) -> float:
    """Emulated clusters: every worker of the plan is a process sharing `host_cores` cores of one host.

    Parameter servers are not counted: they spend the step waiting on the network, and their
    CPU work moving bytes is already in the measured point-to-point bandwidth.
    """
    cores = hw.constants.get("host_cores")
    return max(1.0, plan.dp * plan.tp * plan.pp / cores) if cores else 1.0


def _tp_collectives(profile: ModelProfile) -> int:
    """A micro-batch's tensor-parallel all-reduces, forward and backward (as `_tp_comm` counts them)."""
    return sum(4 if 0 < index < len(profile.layers) - 1 else 1 for index in range(len(profile.layers)))


def _tp_comm(profile: ModelProfile, hw: Hardware, plan: Plan, samples: float) -> float:
    """Megatron: per transformer block 2 all-reduces of the block's output forward and 2 backward
    (Shoeybi et al. 2019, section 3); the vocabulary-parallel embedding adds one forward and the
    head one backward. Layers are told apart by position: GPT is [Embedding, Block..., Head]."""
    if plan.tp == 1:
        return 0.0
    link = group_link(plan.tp, hw.devices_per_node, hw.intra, hw.inter)
    total = 0.0
    for index, layer in enumerate(profile.layers):
        count = 4 if 0 < index < len(profile.layers) - 1 else 1
        total += count * allreduce_time(layer.output_bytes * samples, plan.tp, link, "ring")
    return total


def estimate(profile: ModelProfile, hw: Hardware, plan: Plan, global_batch: int,
             options: Options | None = None) -> Estimate:
    """Predicted step time, throughput and memory of `plan` for `global_batch` samples per step."""
    opts = options or Options()
    if opts.layout != "ddp" and profile.dtype != "fp32" and not profile.half_model:
        raise UserError(f"layout={opts.layout} keeps the model itself in {profile.dtype}: profile it with "
                        "half_model=True (paraloom plan --layout does)")
    model_parallel = plan.tp > 1 or plan.pp > 1 or plan.microbatches > 1
    if global_batch % (plan.dp * plan.microbatches) and model_parallel:
        unit = plan.dp * plan.microbatches
        raise UserError(f"global batch {global_batch} does not split into dp={plan.dp} x "
                        f"microbatches={plan.microbatches}; choose a multiple of {unit}")
    # data-parallel ranks take near-equal shares of a batch that does not split evenly: the step
    # waits for the largest
    micro = -(-global_batch // plan.dp) / plan.microbatches
    slow = host_slowdown(hw, plan)
    dtype = profile.dtype
    sp = plan.sequence_parallel
    fwd = [layer_seconds(layer, hw, dtype, "fwd", micro, plan.tp, sp) * slow for layer in profile.layers]
    bwd = [layer_seconds(layer, hw, dtype, "bwd", micro, plan.tp, sp) * slow for layer in profile.layers]
    if profile.recompute == "full":
        bwd = [b + f for b, f in zip(bwd, fwd, strict=True)]
    stages = split_stages(profile, plan.pp, [f + b for f, b in zip(fwd, bwd, strict=True)])
    pp_link = stream(hw, group_link(plan.pp, hw.devices_per_node, hw.intra, hw.inter,
                                     stride=plan.dp * plan.tp))
    v = plan.virtual_stages
    stage_f, stage_b, tp_s, p2p_s = [], [], 0.0, 0.0
    for start, stop in stages:
        part = profile.slice(start, stop)
        tp_comm = _tp_comm(part, hw, plan, micro)
        if plan.tp > 1 and "host_cores" in hw.constants:  # gloo's all-reduces block the computing thread
            blocking = _tp_collectives(part)
            tp_comm += blocking * arrival_seconds(hw, plan.devices,
                                                  sum(fwd[start:stop] + bwd[start:stop]) / blocking)
        # a micro-batch leaves a stage once per chunk it holds (interleaved: v, the last stage v - 1)
        sends = v - (stop == len(profile.layers))
        send = p2p_time(part.output_bytes * micro / plan.tp, pp_link) * sends
        stage_f.append(sum(fwd[start:stop]) + tp_comm / 2 + send)
        stage_b.append(sum(bwd[start:stop]) + tp_comm / 2 + send)
        tp_s, p2p_s = max(tp_s, tp_comm), max(p2p_s, 2 * send)
    m = plan.microbatches
    per_micro = [f + b for f, b in zip(stage_f, stage_b, strict=True)]
    # GPipe and 1F1B have the same bubble: fill and drain pass once through every stage, the
    # slowest stage sets the pace for the other m - 1 micro-batches (Huang et al. 2019; Narayanan
    # et al. 2019). With one stage this is plain gradient accumulation. Interleaving v chunks per
    # stage fills and drains through chunks a v-th of a stage (Narayanan et al. 2021, section 2.2):
    # (m + (p - 1) / v) x the slowest stage when balanced.
    pipeline = sum(per_micro) / v + (m - 1 / v) * max(per_micro)
    busy = m * max(per_micro)
    compute = sum(fwd) / plan.pp * m + sum(bwd) / plan.pp * m

    # data parallelism: the stage with the most parameters synchronizes the longest
    start, stop = max(stages, key=lambda r: profile.slice(*r).n_params)
    grad_bytes = profile.slice(start, stop).n_params * 4.0 / plan.tp  # gradients reduce in fp32
    update = update_seconds(profile.slice(start, stop), hw, plan.tp, opts.optimizer) * slow
    shards = shard_group(plan, hw.devices_per_node) if plan.shard in FULLY_SHARDED else 1
    if opts.shard_optimizer or plan.shard == "optimizer":
        update /= plan.dp
    if plan.shard in FULLY_SHARDED:  # each unit's gathers and reductions, overlapping compute
        update /= shards
        link = dp_link(hw, plan) if plan.shard != "hybrid" else \
            group_link(shards, hw.devices_per_node, hw.intra, hw.inter, stride=plan.tp)
        # the stage with the most parameters (pp = 1: the whole model) gathers and reduces the longest
        dp_exposed, dp_total = sharded_sync(profile.slice(start, stop), plan, sum(fwd[start:stop]) * m,
                                            sum(bwd[start:stop]) * m, link, hw.inter,
                                            shards, m, reshard=opts.reshard_after_forward,
                                            host_rate=hw.constants.get(HOST_RATE, 0.0) * slow,
                                            gloo="host_cores" in hw.constants,
                                            arrival=lambda s: arrival_seconds(hw, plan.devices, s),
                                            units=opts.shard_units)
    else:
        dp_exposed, dp_total = _dp_sync(profile, hw, plan, opts, (start, stop), fwd, bwd, m, grad_bytes)
    codec = codec_time(hw, plan.compressor, grad_bytes) * slow if plan.dp > 1 else 0.0
    # the batch's copy to the device: host to device where calibrated, at memory bandwidth otherwise
    loading = hw.constants.get("copy_bandwidth.h2d", hw.device.mem_bandwidth)
    data = profile.input_bytes * global_batch / plan.dp / loading
    overhead = hw.constants.get("step_overhead_s", 0.0) * slow
    # replicas that synchronize every step wait for the slowest and pay the engine's per-step work:
    # a constant refined from a measured data-parallel run (runs.refine.sync_residual), 0 otherwise
    synchronous = plan.dp > 1 and not (plan.servers and plan.consistency != "bsp")
    barriers = 1 + _flag_guard(plan, opts)
    sync = hw.constants.get(SYNC_OVERHEAD, 0.0) * slow * barriers if synchronous else 0.0
    step = pipeline + dp_exposed + codec + update + data + overhead + sync
    # samples read from storage (Paleo's T_disk) by a prefetching loader, while the step runs: only
    # what takes longer than the step shows; the step's samples spread over the nodes its replicas use
    nodes = min(plan.dp, -(-plan.devices // hw.devices_per_node))
    read = read_seconds(opts.sample_bytes, global_batch, nodes, hw.constants.get(READ_BANDWIDTH))
    data, step = data + max(0.0, read - step), max(step, read)
    if plan.servers and plan.consistency != "bsp":  # asynchronous workers: a closed queueing network
        link = dp_link(hw, plan, p2p=True)
        push = link.latency + compressed_bytes(grad_bytes, plan.compressor) / link.bandwidth
        pull = link.latency + grad_bytes / link.bandwidth
        own = pipeline + codec + data + overhead
        pushed = compressed_bytes(grad_bytes, plan.compressor)
        per_cycle = server_cpu(hw, plan, opts, pushed, grad_bytes) / plan.dp  # per worker's cycle
        step = asp_cycle(plan.dp, plan.servers, push, pull, own, ps_slices(grad_bytes, plan, opts),
                         server_cpu_s=per_cycle)
        dp_exposed = step - own
    straggler = 0.0
    if opts.straggler > 1 and plan.dp > 1:
        straggler = (opts.straggler - 1) * pipeline
        if plan.servers and plan.consistency != "bsp":  # the others do not wait for it
            straggler = 0.0
        step += straggler
    breakdown = {"compute": compute, "bubble": max(0.0, pipeline - busy), "tp_comm": tp_s * m,
                 "pp_comm": p2p_s * m, "dp_comm_exposed": dp_exposed, "dp_comm_total": dp_total,
                 "codec": codec, "update": update, "data": data, "overhead": overhead, "sync": sync,
                 "straggler": straggler}
    samples = global_batch / step
    if plan.servers and plan.consistency != "bsp" and opts.straggler > 1:
        # asynchronous workers each run at their own pace: the slow one adds its share only
        fast = (plan.dp - 1) / plan.dp * global_batch / step
        samples = fast + global_batch / plan.dp / (step + (opts.straggler - 1) * pipeline)
    per_stage = stage_peaks(profile, plan, stages, micro, opts, shards)
    memory = max(per_stage)
    terms = {k: v for k, v in breakdown.items() if k != "dp_comm_total"}
    phases = {"forward": sum(fwd) / plan.pp * m, "backward": sum(bwd) / plan.pp * m, "update": update}
    return Estimate(plan=plan, step_s=step, samples_per_s=samples, memory_bytes=memory,
                    fits=memory <= hw.device.mem_capacity, bottleneck=max(terms, key=terms.get),
                    breakdown=breakdown, phases=phases, memory_per_stage=tuple(per_stage))


def _flag_guard(plan: Plan, opts: Options) -> bool:
    """Whether the NaN guard all-reduces a flag before the update (data_parallel/engine.py
    `guard_nonfinite`): a second point per step where every replica waits for the slowest. Plain
    averaging of uncompressed, fp16 or bf16 gradients checks the averaged gradients instead; the
    priority scheduler, one-step delay, a sharded optimizer, the other compressors and tensor or
    pipeline parallel replicas (whose guard spans every stage) use the flag. The parameter server
    has no guard."""
    if not opts.guard or plan.dp == 1 or plan.servers:
        return False
    plain = plan.scheduler != "priority" and plan.sync == "sync" and not opts.shard_optimizer \
        and plan.shard == "none"  # sharded runs check their shards and all-reduce a flag
    return not (plain and plan.compressor in ("none", *WIRE_DTYPE) and plan.tp == 1 and plan.pp == 1)


def _dp_sync(profile: ModelProfile, hw: Hardware, plan: Plan, opts: Options, stage: tuple[int, int],
             fwd: list[float], bwd: list[float], m: int, grad_bytes: float) -> tuple[float, float]:
    """(exposed seconds, seconds on the link) of one step's gradient synchronization."""
    if plan.dp == 1:
        return 0.0, 0.0
    link = dp_link(hw, plan)
    start, stop = stage
    if plan.servers:  # BSP: pushes go out during backward, every pull waits for every push
        return ps_bsp_sync(hw, plan, opts, grad_bytes, sum(bwd[start:stop]))

    group = dp_group(hw, plan) if plan.algorithm.startswith("hierarchical_") else None

    def send(nbytes: float) -> float:
        if plan.compressor != "none":  # a compressor's payload goes flat, by the algorithm inside
            return compressed_sync_time(nbytes, plan.dp, link, plan.compressor, plan.algorithm)
        if group is not None:
            per_node, measured, nics = group
            return group_allreduce_time(nbytes, plan.dp // per_node, per_node, hw.intra, measured,
                                        plan.algorithm, nics)
        return allreduce_time(nbytes, plan.dp, link, plan.algorithm)

    # backward of the last micro-batch is the window (earlier ones run under no_sync)
    layers = [overlap.LayerTimes(fwd[i], bwd[i], profile.layers[i].param_count * 4.0 / plan.tp)
              for i in range(start, stop)]
    bucket, first = opts.bucket_mb * 2**20, opts.first_bucket_mb * 2**20
    total = overlap.total_comm(layers, send, bucket)
    if plan.sync == "one_step_delay":
        exposed = overlap.one_step_delay_exposed(layers, send, bucket)
    elif plan.scheduler == "fifo":
        exposed = overlap.fifo_exposed(layers, send, bucket)
    elif plan.scheduler == "priority" and plan.pp == 1 and m == 1:
        piece = opts.partition_mb * 2**20
        window = int(opts.credit_mb * 2**20 // piece)  # pieces the credit window lets out at once
        exposed = overlap.priority_exposed(layers, send, piece, in_flight=window)
        # a piece is issued, tracked and waited for by threads on cores the compute keeps busy,
        # past the latency calibrated for this group size (whose processes share the host too, so
        # a piece's cost is not scaled by its hops or the host's share); per step the scheduler's
        # own thread and deferred updates take CPU from the compute
        charge = (hw.constants.get(PIECE_OVERHEAD, 0.0) * overlap.piece_count(layers, piece)
                  + hw.constants.get(PRIORITY_OVERHEAD, 0.0) * host_slowdown(hw, plan))
        return unhidden_cpu(exposed, total, comm_cpu(hw, plan, grad_bytes)) + charge, total
    else:
        exposed = overlap.wait_free_exposed(layers, send, bucket, first)
    return unhidden_cpu(exposed, total, comm_cpu(hw, plan, grad_bytes)), total
