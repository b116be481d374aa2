"""The cost model on hand-sized models and hardware: every term checked against a computed value."""

import json
import math

import pytest

from paraloom.config.errors import UserError
from paraloom.perfmodel.cost.cpu import arrival_key, arrival_seconds
from paraloom.perfmodel.cost.memory import activation_share, in_flight
from paraloom.perfmodel.cost.network import allreduce_time
from paraloom.perfmodel.cost.step_time import estimate, split_stages
from paraloom.perfmodel.hardware import Device, Hardware, Link, load_hardware
from paraloom.perfmodel.measure.profile import profile_model
from paraloom.perfmodel.model_profile import LayerProfile, ModelProfile
from paraloom.perfmodel.plan import Options, Plan

GFLOP = 1e9


def layer(name, fwd=1e6, params=1000, out=100.0, act=400.0):
    """fwd FLOPs per sample (all matmul), backward twice that."""
    return LayerProfile(name=name, fwd_flops={"matmul": fwd}, bwd_flops={"matmul": 2 * fwd},
                        param_count=params, activation_bytes=act, output_bytes=out)


def model(n=4, **kw):
    return ModelProfile(spec="gpt:layers=2", dtype="fp32", recompute="none",
                        layers=tuple(layer(str(i), **kw) for i in range(n)), input_bytes=8.0)


def hardware(per_node=1, inter_bw=1e6, intra_bw=1e9, latency=0.0, **constants):
    device = Device("toy", {"fp32": GFLOP}, {"matmul": 1.0, "conv": 1.0, "attention": 1.0, "other": 1.0},
                    mem_bandwidth=1e18, mem_capacity=1e12)
    return Hardware("toy", device, per_node, Link("intra", intra_bw, latency),
                    Link("inter", inter_bw, latency), constants=constants)


def test_one_device_is_forward_plus_backward_at_the_achieved_rate():
    e = estimate(model(), hardware(), Plan(), 10)
    # 4 layers x (1 + 2) MFLOP x 10 samples at 1 GFLOP/s = 0.12 s
    assert e.step_s == pytest.approx(0.12, rel=1e-6)
    assert e.breakdown["compute"] == pytest.approx(0.12, rel=1e-6)
    assert e.samples_per_s == pytest.approx(10 / 0.12, rel=1e-6)
    assert e.bottleneck == "compute"


def test_fifo_data_parallel_adds_the_whole_all_reduce():
    hw = hardware()
    e = estimate(model(), hw, Plan(dp=4, scheduler="fifo"), 40)
    grad = 4 * 1000 * 4.0  # fp32 gradients of 4000 parameters
    assert e.breakdown["dp_comm_exposed"] == pytest.approx(allreduce_time(grad, 4, hw.inter, "ring"))
    assert e.step_s == pytest.approx(0.12 + allreduce_time(grad, 4, hw.inter, "ring"), rel=1e-6)


def test_wait_free_and_one_step_delay_hide_communication_behind_compute():
    hw = hardware(inter_bw=2e5)  # 16 KB of gradients: 0.12 s on the ring, as long as backward
    layer_buckets = Options(bucket_mb=4000 / 2**20, first_bucket_mb=4000 / 2**20)  # a bucket per layer
    fifo = estimate(model(), hw, Plan(dp=4, scheduler="fifo"), 40, layer_buckets)
    free = estimate(model(), hw, Plan(dp=4, scheduler="wait_free"), 40, layer_buckets)
    delay = estimate(model(), hw, Plan(dp=4, sync="one_step_delay"), 40, layer_buckets)
    assert delay.step_s < free.step_s < fifo.step_s
    one_bucket = estimate(model(), hw, Plan(dp=4, scheduler="wait_free"), 40)  # 16 KB < the 1 MB first bucket
    assert one_bucket.step_s == pytest.approx(fifo.step_s)
    assert delay.breakdown["dp_comm_exposed"] == 0.0


def test_pipeline_bubble_is_stages_minus_one_over_m_plus_stages_minus_one():
    hw = hardware(per_node=1, inter_bw=1e15)  # p2p free
    for pp, m in ((2, 4), (4, 8), (4, 4)):
        e = estimate(model(n=8), hw, Plan(pp=pp, microbatches=m), 8 * m)
        busy = e.step_s - e.breakdown["bubble"]
        assert e.breakdown["bubble"] / e.step_s == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-6)
        assert busy == pytest.approx(8 * 3e6 * 8 * m / GFLOP / pp, rel=1e-6)


def test_interleaving_shrinks_the_bubble_v_fold_and_sends_v_times_as_often():
    free = hardware(per_node=1, inter_bw=1e15)  # p2p free
    for pp, m, v in ((2, 8, 2), (4, 8, 2), (2, 4, 4)):
        plan = Plan(pp=pp, microbatches=m, schedule="interleaved_1f1b", virtual_stages=v)
        e = estimate(model(n=8), free, plan, 8 * m)
        assert e.breakdown["bubble"] / e.step_s == pytest.approx((pp - 1) / (v * m + pp - 1), rel=1e-6)
        assert e.step_s < estimate(model(n=8), free, Plan(pp=pp, microbatches=m), 8 * m).step_s
    slow = hardware(per_node=1, inter_bw=1e6)
    plain, interleaved = (estimate(model(n=8), slow, Plan(pp=2, microbatches=4, **kw), 32) for kw in
                          ({}, {"schedule": "interleaved_1f1b", "virtual_stages": 2}))
    # the first stage sends once per chunk (2), the last once (its first chunk): 3 sends against 1
    assert interleaved.breakdown["pp_comm"] == pytest.approx(2 * plain.breakdown["pp_comm"], rel=1e-6)
    assert "m4 interleaved_1f1b v2" in interleaved.plan.label()


def test_interleaved_stages_hold_their_warm_up_chunks():
    from paraloom.perfmodel.cost.memory import in_flight

    assert in_flight("interleaved_1f1b", 8, 4, 0, 2) == (3 * 2 + 4 + 1) / 2  # pp + (pp - 1) / v
    assert in_flight("interleaved_1f1b", 8, 4, 3, 2) == (0 + 4 + 1) / 2
    assert in_flight("1f1b", 8, 4, 0) == 4 and in_flight("interleaved_1f1b", 8, 4, 0, 1) == 4


def test_tensor_parallel_splits_matmul_and_pays_four_all_reduces_per_block():
    hw = hardware(per_node=2, intra_bw=1e6)
    e = estimate(model(n=4), hw, Plan(tp=2), 10)
    # embedding 1 + two blocks x 4 + head 1 = 10 all-reduces of 100 B x 10 samples over tp = 2
    assert e.breakdown["tp_comm"] == pytest.approx(10 * allreduce_time(1000.0, 2, hw.intra, "ring"))
    assert e.breakdown["compute"] == pytest.approx(0.06, rel=1e-6)


def test_emulated_devices_share_the_host_cores():
    alone = estimate(model(), hardware(), Plan(dp=4, scheduler="fifo"), 40)
    shared = estimate(model(), hardware(host_cores=2), Plan(dp=4, scheduler="fifo"), 40)
    assert shared.breakdown["compute"] == pytest.approx(2 * alone.breakdown["compute"])


def test_an_all_reduce_measured_at_the_groups_size_and_wire_dtype_replaces_the_inter_link():
    grad = 4 * 1000 * 4.0
    measured = {"allreduce.n4.float32.native.bandwidth": 5e5, "allreduce.n4.float32.native.latency": 1e-3,
                "allreduce.n4.float16.native.bandwidth": 2.5e5, "allreduce.n4.float16.native.latency": 2e-3}
    hw = hardware(**measured)
    at_four = Link("n4", 5e5, 1e-3)
    e = estimate(model(), hw, Plan(dp=4, scheduler="fifo", algorithm="native"), 40)
    assert e.breakdown["dp_comm_exposed"] == pytest.approx(allreduce_time(grad, 4, at_four, "native"))
    fp16 = estimate(model(), hw, Plan(dp=4, scheduler="fifo", compressor="fp16", algorithm="native"), 40)
    # half the bytes at half the bandwidth (gloo sums fp16 slower), twice the latency
    assert fp16.breakdown["dp_comm_exposed"] == pytest.approx(
        allreduce_time(grad / 2, 4, Link("n4 fp16", 2.5e5, 2e-3), "native"))
    unmeasured = (Plan(dp=2, scheduler="fifo", algorithm="native"),  # another group size
                  Plan(dp=4, scheduler="fifo", compressor="bf16", algorithm="native"),  # another dtype
                  Plan(dp=4, scheduler="fifo", algorithm="ring"))  # another algorithm
    for plan in unmeasured:
        plain = estimate(model(), hardware(), plan, 40)  # without the constants: the inter link
        assert estimate(model(), hw, plan, 40).step_s == pytest.approx(plain.step_s)


def test_the_all_reduces_cpu_work_is_not_hidden_behind_backward():
    """Wait-free hides half of a 0.12 s all-reduce behind backward (a bucket per layer); with the
    all-reduce measured busy on the CPU for 0.06 s (half its time), half the hidden part comes
    back. fp16 all-reduces half the bytes with the fp16 constant."""
    per_layer = Options(bucket_mb=4000 / 2**20, first_bucket_mb=4000 / 2**20)
    plan = Plan(dp=4, scheduler="wait_free", algorithm="native")
    link = {"allreduce.n4.float32.native.bandwidth": 2e5, "allreduce.n4.float32.native.latency": 0.0}
    plain = estimate(model(), hardware(**link), plan, 40, per_layer)
    total, exposed = plain.breakdown["dp_comm_total"], plain.breakdown["dp_comm_exposed"]
    assert total == pytest.approx(0.12) and exposed == pytest.approx(0.06)
    cpu = {"allreduce.n4.float32.native.cpu_s_per_byte": 0.06 / 16000}
    busy = estimate(model(), hardware(**link, **cpu), plan, 40, per_layer)
    assert busy.breakdown["dp_comm_exposed"] == pytest.approx(exposed + (total - exposed) * 0.5)
    assert busy.step_s == pytest.approx(plain.step_s + (total - exposed) * 0.5)
    fp16 = Plan(dp=4, scheduler="fifo", algorithm="native", compressor="fp16")
    fp16_cpu = {"allreduce.n4.float16.native.cpu_s_per_byte": 1.0}  # more than the whole all-reduce
    fifo = estimate(model(), hardware(**link, **fp16_cpu), fp16, 40, per_layer)  # nothing hidden
    assert fifo.breakdown["dp_comm_exposed"] == pytest.approx(fifo.breakdown["dp_comm_total"])


def test_a_parameter_server_moving_bytes_with_its_cpu_bounds_the_bsp_step():
    """16 KB of gradients, 4 workers, 1 server, links fast enough to be no limit: the server's CPU
    moves 4 x (16 KB in + 16 KB out) at 1 us a byte (half the 2-worker all-reduce's 2 us per byte
    of tensor) = 0.128 s, which the step pays beyond backward's 0.08 s."""
    plan = Plan(dp=4, servers=1, consistency="bsp")
    fast = estimate(model(), hardware(inter_bw=1e12), plan, 40)
    assert fast.breakdown["dp_comm_total"] < 1e-6
    cpu = hardware(inter_bw=1e12, **{"allreduce.n2.float32.native.cpu_s_per_byte": 2e-6})
    busy = estimate(model(), cpu, plan, 40)
    assert busy.breakdown["dp_comm_total"] == pytest.approx(0.128)
    # the worker's own 32 KB (0.032 s of CPU, a quarter of the total) are not hidden by backward
    exposed = 0.128 - 0.08
    assert busy.breakdown["dp_comm_exposed"] == pytest.approx(exposed + (0.128 - exposed) * 0.25)
    asp = Plan(dp=4, servers=1, consistency="asp")
    assert estimate(model(), cpu, asp, 40).step_s > estimate(model(), hardware(inter_bw=1e12), asp, 40).step_s


def test_a_parameter_servers_cpu_per_message_adds_to_its_bytes():
    """The same 16 KB, 4 workers: 4 layers of 4 KB travel as ceil(16 KB / 1 KB) = 16 slices with
    ps_partition_mb = 1/1024, so the server handles 4 x 16 = 64 requests a step; at 1 ms each they
    add 0.064 s to the 0.128 s of bytes. On one node the bytes cost loopback's TCP CPU instead."""
    plan, opts = Plan(dp=4, servers=1, consistency="bsp"), Options(ps_partition_mb=1 / 1024)
    cpu = {"allreduce.n2.float32.native.cpu_s_per_byte": 2e-6, "ps.server_s_per_message": 1e-3}
    busy = estimate(model(), hardware(inter_bw=1e12, **cpu), plan, 40, opts)
    assert busy.breakdown["dp_comm_total"] == pytest.approx(0.128 + 0.064)
    local = hardware(per_node=4, intra_bw=1e12, **cpu, **{"tcp_cpu_s_per_byte.intra": 0.5e-6})
    assert estimate(model(), local, plan, 40, opts).breakdown["dp_comm_total"] == pytest.approx(0.064 + 0.064)
    asp = Plan(dp=4, servers=1, consistency="asp")
    without = hardware(inter_bw=1e12, **{"allreduce.n2.float32.native.cpu_s_per_byte": 2e-6})
    assert estimate(model(), hardware(inter_bw=1e12, **cpu), asp, 40, opts).step_s > \
        estimate(model(), without, asp, 40, opts).step_s


def test_a_parameter_servers_updates_are_one_a_slice_and_clock_under_bsp_one_a_push_else():
    """16 slices, 4 workers, 1 ms an optimizer step: BSP adds 16 x 1 ms to the server's CPU a step,
    ASP 4 x 16 x 1 ms (one step a push)."""
    from paraloom.perfmodel.cost.cpu import server_cpu

    opts = Options(ps_partition_mb=1 / 1024)
    hw, base = hardware(inter_bw=1e12, **{"ps.server_s_per_update": 1e-3}), hardware(inter_bw=1e12)
    for consistency, extra in (("bsp", 0.016), ("asp", 0.064), ("ssp", 0.064)):
        plan = Plan(dp=4, servers=1, consistency=consistency)
        added = server_cpu(hw, plan, opts, 16384, 16384) - server_cpu(base, plan, opts, 16384, 16384)
        assert added == pytest.approx(extra)


def test_a_synchronous_steps_own_cost_is_paid_by_synchronous_replicas_only():
    """sync_overhead_s: 5 ms per step of all-reduce and BSP plans, times the host's share (4 workers
    on 2 cores: 10 ms); nothing for one replica or for asynchronous workers."""
    plain, with_sync = hardware(inter_bw=1e9), hardware(inter_bw=1e9, sync_overhead_s=0.005)
    for plan, extra in ((Plan(dp=4), 0.005), (Plan(dp=4, servers=1), 0.005), (Plan(), 0.0),
                        (Plan(tp=2, pp=2), 0.0), (Plan(dp=4, servers=1, consistency="asp"), 0.0)):
        e = estimate(model(), with_sync, plan, 40)
        assert e.step_s - estimate(model(), plain, plan, 40).step_s == pytest.approx(extra)
        assert e.breakdown["sync"] == pytest.approx(extra)
    shared = hardware(inter_bw=1e9, sync_overhead_s=0.005, host_cores=2)
    assert estimate(model(), shared, Plan(dp=4), 40).breakdown["sync"] == pytest.approx(0.01)


def test_the_priority_scheduler_pays_per_piece_and_per_step():
    """piece_overhead_s: 1 ms per piece. The toy's 4 layers of 4,000 gradient bytes in 1,000-byte
    partitions are 16 pieces: 16 ms, for 2 or 4 replicas and however many cores the host has.
    priority_overhead_s: 2 ms a step times the host's share (4 workers on 2 cores: 4 ms). Other
    schedulers pay neither."""
    opts = Options(partition_mb=1000 / 2**20, credit_mb=4000 / 2**20)
    costs = {"piece_overhead_s": 1e-3, "priority_overhead_s": 2e-3}
    for plan, extra in ((Plan(dp=4, scheduler="priority"), 0.018), (Plan(dp=2, scheduler="priority"), 0.018),
                        (Plan(dp=4), 0.0), (Plan(dp=4, scheduler="fifo"), 0.0)):
        base = estimate(model(), hardware(inter_bw=1e9), plan, 40, opts)
        charged = estimate(model(), hardware(inter_bw=1e9, **costs), plan, 40, opts)
        assert charged.step_s - base.step_s == pytest.approx(extra)
        exposed = charged.breakdown["dp_comm_exposed"] - base.breakdown["dp_comm_exposed"]
        assert exposed == pytest.approx(extra)
    shared, base = hardware(inter_bw=1e9, host_cores=2, **costs), hardware(inter_bw=1e9, host_cores=2)
    plan = Plan(dp=4, scheduler="priority")
    assert (estimate(model(), shared, plan, 40, opts).step_s - estimate(model(), base, plan, 40, opts).step_s
            == pytest.approx(0.016 + 0.004))


@pytest.mark.parametrize("plan,barriers", [(Plan(dp=2), 1), (Plan(dp=2, compressor="fp16"), 1),
                                           (Plan(dp=2, scheduler="fifo", compressor="bf16"), 1),
                                           (Plan(dp=2, scheduler="priority"), 2),
                                           (Plan(dp=2, compressor="topk"), 2),
                                           (Plan(dp=2, sync="one_step_delay"), 2), (Plan(dp=2, tp=2), 2)])
def test_the_nan_guards_flag_is_one_more_synchronization(plan, barriers):
    """Modes that cannot check the averaged gradients all-reduce a flag first: a second wait for the
    slowest replica (engine.guard_nonfinite); with guard.nan off, one wait is left."""
    hw = hardware(inter_bw=1e9, sync_overhead_s=0.005)
    assert estimate(model(), hw, plan, 40).breakdown["sync"] == pytest.approx(0.005 * barriers)
    assert estimate(model(), hw, plan, 40, Options(guard=False)).breakdown["sync"] == pytest.approx(0.005)


def test_straggler_slows_bsp_but_not_asp():
    hw = hardware(inter_bw=1e9)
    opts = Options(straggler=2.0)
    bsp = estimate(model(), hw, Plan(dp=4, servers=1, consistency="bsp"), 40, opts)
    asp = estimate(model(), hw, Plan(dp=4, servers=1, consistency="asp"), 40, opts)
    even = estimate(model(), hw, Plan(dp=4, servers=1, consistency="asp"), 40)
    assert bsp.samples_per_s < asp.samples_per_s < even.samples_per_s


def test_memory_counts_weights_grads_adam_buffers_and_in_flight_activations():
    e = estimate(model(), hardware(), Plan(), 10)
    params = 4000
    # fp32 weights 4 + Adam 8 bytes per parameter stay; gradients (4 per parameter) are made as backward
    # frees the activations (4 layers x 400 B x 10 samples), so the peak holds the larger of the two
    assert e.memory_bytes == pytest.approx(params * 12 + max(4 * 400 * 10, params * 4))
    big = estimate(model(), hardware(), Plan(), 40)
    assert big.memory_bytes == pytest.approx(params * 12 + 4 * 400 * 40)
    assert in_flight("gpipe", 8, 4, 0) == 8 and in_flight("1f1b", 8, 4, 0) == 4
    assert in_flight("1f1b", 8, 4, 3) == 1 and in_flight("1f1b", 2, 4, 0) == 2
    assert activation_share(1) == 1.0 and activation_share(4) == pytest.approx(10 / 34 + 24 / 34 / 4)
    gpipe = estimate(model(n=8), hardware(), Plan(pp=4, microbatches=8, schedule="gpipe"), 64)
    one_f = estimate(model(n=8), hardware(), Plan(pp=4, microbatches=8, schedule="1f1b"), 64)
    assert gpipe.memory_bytes > one_f.memory_bytes


def test_split_stages_minimizes_the_slowest_stage():
    profile = model(n=5)
    assert split_stages(profile, 2, [1, 1, 1, 1, 4]) == [(0, 4), (4, 5)]
    assert split_stages(profile, 5, [1, 1, 1, 1, 4]) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert split_stages(profile, 3, [3, 1, 1, 1, 3]) == [(0, 1), (1, 4), (4, 5)]
    # one stage is the whole model, however the seconds round: Python 3.12's sum() of these is 0.6
    # while adding them one by one gives 0.6000000000000001 (it once made a second stage, seen on a GPU)
    assert split_stages(profile, 1, [0.1, 0.2, 0.3, 1e-17, 0.0]) == [(0, 5)]
    assert len(split_stages(profile, 2, [0.1, 0.2, 0.3, 0.1, 0.2])) == 2
    with pytest.raises(UserError, match="pp=6 stages need at least 6 layers"):
        split_stages(profile, 6, [1] * 5)


def test_bad_plans_and_batches_are_one_line_errors():
    with pytest.raises(UserError, match="choose a multiple of 12"):
        estimate(model(), hardware(), Plan(dp=3, microbatches=4), 10)
    with pytest.raises(UserError, match="scheduler='lifo' is not valid"):
        Plan(scheduler="lifo")
    with pytest.raises(UserError, match="whole replicas"):
        Plan(tp=2, servers=1)
    plan = Plan(dp=4, tp=2, pp=2, microbatches=8, scheduler="priority")
    assert plan.label() == "dp4 tp2 pp2 m8 1f1b priority"


def test_winograd_divides_the_3x3_convolutions_flops_where_the_device_says_and_was_not_measured():
    from dataclasses import replace

    from paraloom.perfmodel.hardware import load_hardware
    from paraloom.perfmodel.measure.profile import profile_model

    vgg = profile_model("vgg16")
    p100 = load_hardware("p100-ib-edr")
    assert p100.device.winograd == {"fp32": 2.6} and load_hardware("a100-ib-hdr").device.winograd == {}
    assert load_hardware("v100-ib-edr").device.winograd == {"fp32": 2.25}  # F(2x2, 3x3) where not fitted
    direct = replace(p100, device=replace(p100.device, winograd={}))
    with_gain, without = (estimate(vgg, hw, Plan(), 8).breakdown["compute"] for hw in (p100, direct))
    conv = sum(layer.fwd_flops["conv"] + layer.bwd_flops["conv"] for layer in vgg.layers) * 8 \
        / p100.achieved_flops("fp32", "conv")
    assert without - with_gain == pytest.approx(conv * (1 - 1 / 2.6), rel=0.02)  # VGG's convs are all 3x3
    measured = replace(p100, constants={"flops.fp32.conv": p100.achieved_flops("fp32", "conv")})
    assert estimate(vgg, measured, Plan(), 8).breakdown["compute"] == pytest.approx(without)


def test_winograds_5x5_factor_is_the_same_tiles_and_a_frameworks_op_overhead_adds_per_kernel():
    from dataclasses import replace

    from paraloom.perfmodel.cost.device import layer_seconds, winograd_5x5

    assert winograd_5x5(2.25) == pytest.approx(100 / 36)  # F(2x2, 3x3) -> F(2x2, 5x5)
    assert winograd_5x5(4.0) == pytest.approx(400 / 64)  # F(4x4, 3x3) -> F(4x4, 5x5)
    alexnet, p100 = profile_model("alexnet"), load_hardware("p100-ib-edr")
    direct = replace(p100, device=replace(p100.device, winograd={}))
    layer = next(layer for layer in alexnet.layers if layer.fwd_winograd5 > 0)
    def seconds(hw, phase):
        return layer_seconds(layer, hw, "fp32", phase, 64, 1)

    saved = seconds(direct, "fwd") - seconds(p100, "fwd")
    rate = p100.achieved_flops("fp32", "conv")
    gain = p100.device.winograd["fp32"]
    expected = 64 * (layer.fwd_winograd * (1 - 1 / gain)
                     + layer.fwd_winograd5 * (1 - 1 / winograd_5x5(gain))) / rate
    assert saved == pytest.approx(expected)
    slow = replace(p100, constants={"op_overhead_s": 1e-4})
    added = seconds(slow, "bwd") - seconds(p100, "bwd")
    assert layer.bwd_kernels > 0 and added == pytest.approx(layer.bwd_kernels * 1e-4)


def test_a_device_mapping_may_give_winograd_factors_and_refuses_ones_below_one():
    from paraloom.perfmodel.hardware import Hardware

    base = "device: {preset: v100, winograd: {fp32: 4, fp16: 2.25}}\ninter: 100gbe\n"
    hw = Hardware.from_yaml(base)
    assert hw.device.winograd == {"fp32": 4.0, "fp16": 2.25}
    assert Hardware.from_yaml(hw.to_yaml()).device.winograd == hw.device.winograd
    with pytest.raises(UserError, match="winograd factors must be at least 1"):
        Hardware.from_yaml("device: {preset: v100, winograd: {fp32: 0.5}}\ninter: 100gbe\n")
    custom = ("device: {name: x, peak_flops: {fp32: 1e12}, efficiency: {matmul: 1, conv: 1, attention: 1, "
              "other: 1}, mem_bandwidth: 1e11, mem_capacity: 1e9}\ndevices_per_node: 1\nintra: pcie4\n"
              "inter: 100gbe\n")
    assert Hardware.from_yaml(custom).device.winograd == {}


def test_data_parallel_groups_share_a_nodes_adapters_as_their_algorithm_sends():
    """16 data-parallel ranks on two 8-GPU nodes: halving-doubling sends 8 flows through a node's one
    adapter at once (an eighth each), a ring one flow; 8 adapters give each flow its own."""
    profile = profile_model("gpt:layers=4,hidden=1024,heads=16,seq=128")

    def comm(preset: str, algorithm: str) -> float:
        est = estimate(profile, load_hardware(preset), Plan(dp=16, algorithm=algorithm), 256)
        return est.breakdown["dp_comm_total"]

    one_nic, eight = "h100-100gbe", "h100-ib-ndr"  # 100 GbE: one adapter a node; NDR: one per GPU
    assert comm(one_nic, "halving_doubling") > 4 * comm(one_nic, "ring")
    assert comm(eight, "halving_doubling") < 1.5 * comm(eight, "ring")
    # summed inside each node first (Goyal et al. 2017): one vector's worth through the adapter
    assert comm(one_nic, "hierarchical_halving_doubling") < comm(one_nic, "halving_doubling") / 4
    # tp = 2 puts two data-parallel groups on each node: they share its one adapter
    tp = [estimate(profile, load_hardware(one_nic), Plan(dp=d, tp=t), 256).breakdown["dp_comm_total"]
          for d, t in ((16, 1), (16, 2))]
    assert tp[1] > 0.9 * tp[0]  # half the bytes (tp halves the gradient) at half the bandwidth


def test_framework_layouts_hold_what_their_sources_say(capsys):
    """Megatron-LM's fp32 main_grad layout: 18 bytes a parameter in fp16 with Adam; ZeRO's stages
    (Rajbhandari et al. 2020): 4 + 12/N_d, 2 + 14/N_d and 16/N_d."""
    from paraloom.cli import main
    from paraloom.perfmodel.cost.memory import layout_state

    spec = "gpt:layers=2,hidden=256,heads=4,seq=64"
    half = profile_model(spec, dtype="fp16", half_model=True)
    n = half.n_params
    expected = {"megatron": 18, "zero1": 4 + 12 / 8, "zero2": 2 + 14 / 8, "zero3": 16 / 8}
    for layout, per_param in expected.items():
        assert sum(layout_state(half, Plan(dp=8), layout, "adam").values()) == pytest.approx(per_param * n)
    # the model in half precision keeps fewer activation bytes than autocast's fp32 residual stream
    mixed = profile_model(spec, dtype="fp16")
    assert half.grad_bytes == 2 * n and mixed.grad_bytes == 4 * n
    assert half.activation_bytes() < mixed.activation_bytes()
    hw = load_hardware("a100-hdr")
    peaks = [estimate(half, hw, Plan(dp=8), 64, Options(layout=lay)).memory_bytes
             for lay in ("megatron", "zero1", "zero2", "zero3")]
    assert peaks == sorted(peaks, reverse=True)
    with pytest.raises(UserError, match="half_model=True"):
        estimate(mixed, hw, Plan(dp=8), 64, Options(layout="megatron"))
    with pytest.raises(UserError, match="memory layout"):
        Options(layout="fsdp")
    argv = ["plan", "--model", spec, "--cluster", "a100-hdr", "--nodes", "1", "--dtype", "fp16",
            "--global-batch", "64", "--plan", "dp=8", "--layout", "zero3"]
    assert main(argv) == 0
    assert main([*argv, "--emit", "x.yaml"]) == 2
    assert "paraloom trains in the ddp layout" in capsys.readouterr().err


def test_samples_read_from_storage_show_only_beyond_the_step(tmp_path):
    """A prefetching loader reads the next samples while the step runs (Paleo's T_disk): a read
    shorter than the step costs nothing, a longer one sets the step; the samples of a step are spread
    over the nodes its replicas run on."""
    from paraloom.perfmodel.cost.storage import measure_read_rate

    profile = profile_model("mlp")
    base = load_hardware("a100-hdr")
    hw = Hardware(name="disk", device=base.device, devices_per_node=8, intra=base.intra, inter=base.inter,
                  constants={"storage.read_bandwidth": 100e6}, nics_per_node=8)
    quiet = estimate(profile, hw, Plan(dp=8), 512)
    small = estimate(profile, hw, Plan(dp=8), 512, Options(sample_bytes=1.0))
    assert small.step_s == quiet.step_s > 512 / 100e6  # 512 bytes a step read in 5 us, inside the step
    big = estimate(profile, hw, Plan(dp=8), 512, Options(sample_bytes=110e3))  # ImageNet's JPEGs
    assert big.step_s == pytest.approx(110e3 * 512 / 100e6)  # 0.56 s of reading on the one node
    assert big.breakdown["data"] == pytest.approx(big.step_s - quiet.step_s + quiet.breakdown["data"])
    two_nodes = estimate(profile, hw, Plan(dp=16), 512, Options(sample_bytes=110e3))
    assert two_nodes.step_s == pytest.approx(big.step_s / 2)
    with pytest.raises(UserError, match="storage.read_bandwidth"):
        estimate(profile, base, Plan(dp=8), 512, Options(sample_bytes=110e3))
    rate, dropped = measure_read_rate(tmp_path, nbytes=8 << 20)
    assert rate > 1e6 and dropped and not list(tmp_path.iterdir())  # nothing left behind
    with pytest.raises(UserError, match="is not a directory"):
        measure_read_rate(tmp_path / "absent")


def test_plan_takes_the_bytes_a_sample_is_stored_as(tmp_path, capsys):
    from paraloom.cli import main

    profile = tmp_path / "disk.yaml"
    profile.write_text("device: a100\ninter: ib-hdr\nconstants: {storage.read_bandwidth: 100000000}\n")
    argv = ["plan", "--model", "mlp", "--cluster", str(profile), "--nodes", "1", "--global-batch", "512",
            "--plan", "dp=8", "--json", str(tmp_path / "p.json")]
    assert main([*argv, "--sample-bytes", "110 KB"]) == 0
    estimate_ = json.loads((tmp_path / "p.json").read_text())["estimate"]
    assert estimate_["step_s"] == pytest.approx(110e3 * 512 / 100e6)  # the node's reading sets the step
    assert main([*argv, "--sample-bytes", "lots"]) == 2
    assert "--sample-bytes='lots' is not a quantity in bytes" in capsys.readouterr().err


def test_sequence_parallelism_splits_what_tensor_parallelism_keeps_whole(tmp_path, capsys):
    """Korthikanti et al. 2022: with sequence parallelism a tp rank keeps 1/t of every activation (not
    10/34 whole) and runs 1/t of the element-wise work; the collectives move the same bytes."""
    from paraloom.cli import main
    from paraloom.perfmodel.planner import parse_plan

    profile = profile_model("gpt:layers=4,hidden=512,heads=8,seq=256", dtype="bf16")
    hw = load_hardware("h100-ib-ndr")
    plain, sp = (estimate(profile, hw, Plan(tp=8, sequence_parallel=s), 8) for s in (False, True))
    assert sp.memory_bytes < plain.memory_bytes and sp.step_s < plain.step_s
    assert sp.breakdown["tp_comm"] == plain.breakdown["tp_comm"]
    assert activation_share(8, sequence_parallel=True) == 1 / 8 < activation_share(8)
    assert parse_plan("tp=8,sequence_parallel=true") == Plan(tp=8, sequence_parallel=True)
    assert Plan(tp=8, sequence_parallel=True).label() == "dp1 tp8 sp"
    with pytest.raises(UserError, match="true only with tp > 1"):
        Plan(sequence_parallel=True)
    argv = ["plan", "--model", "gpt:layers=4,hidden=512,heads=8,seq=256", "--cluster", "h100-ib-ndr",
            "--nodes", "1", "--global-batch", "8", "--plan", "tp=8,sequence_parallel=true"]
    assert main(argv) == 0
    assert main([*argv, "--emit", str(tmp_path / "x.yaml")]) == 2
    assert "does not split the sequence" in capsys.readouterr().err


def test_a_node_that_sums_its_workers_gradients_pushes_once(tmp_path, capsys):
    """TensorFlow's distributed_replicated: 16 workers on two 8-GPU nodes push as two, after a ring
    all-reduce inside each node; the servers move an eighth of the bytes."""
    from paraloom.cli import main
    from paraloom.perfmodel.cost.network import ps_pull_time, ps_time

    profile = profile_model("resnet50")
    hw = load_hardware("v100-25gbe")
    each, summed = (estimate(profile, hw, Plan(dp=16, servers=2, ps_node_sum=s), 512) for s in (False, True))
    grad = profile.n_params * 4.0
    slices = math.ceil(grad / 2 / (Options().ps_partition_mb * 2**20))  # a shard's messages
    wire = ps_time(grad, 2, 2, hw.inter, slices=slices) + allreduce_time(grad, 8, hw.intra, "ring")
    assert summed.breakdown["dp_comm_total"] == pytest.approx(wire, rel=1e-6)
    assert summed.breakdown["dp_comm_total"] < each.breakdown["dp_comm_total"] / 4
    assert Plan(dp=16, servers=2, ps_node_sum=True).label() == "dp16 ps2 bsp node-sum"
    with pytest.raises(UserError, match="only with servers and consistency bsp"):
        Plan(dp=16, servers=2, consistency="asp", ps_node_sum=True)
    # the GPUs copy the variables back only once the servers applied every push: the pull is exposed
    # even where backward is long enough to hide the whole step's traffic
    pull = ps_pull_time(grad, 2, 2, hw.inter, slices)
    assert wire - pull < summed.phases["backward"]
    assert summed.breakdown["dp_comm_exposed"] == pytest.approx(pull, rel=1e-6)
    assert each.breakdown["dp_comm_exposed"] == pytest.approx(
        max(0.0, each.breakdown["dp_comm_total"] - each.phases["backward"]), rel=1e-6)
    # the servers on the workers' two nodes: each node keeps its own shard's traffic off its NIC
    colocated = Plan(dp=16, servers=2, ps_node_sum=True, ps_colocated=True)
    shared = estimate(profile, hw, colocated, 512)
    near = ps_time(grad, 2, 2, hw.inter, slices=slices, colocated=True)
    local = allreduce_time(grad, 8, hw.intra, "ring")
    assert shared.breakdown["dp_comm_total"] == pytest.approx(near + local)
    assert near < ps_time(grad, 2, 2, hw.inter, slices=slices) * 0.6
    assert colocated.label() == "dp16 ps2 bsp node-sum co-located"
    with pytest.raises(UserError, match="true only with ps_node_sum"):
        Plan(dp=16, servers=2, ps_colocated=True)
    argv = ["plan", "--model", "resnet50", "--cluster", "v100-25gbe", "--nodes", "2", "--global-batch", "512",
            "--plan", "dp=16,servers=2,ps_node_sum=true"]
    assert main(argv) == 0
    assert main([*argv, "--emit", str(tmp_path / "x.yaml")]) == 2
    assert "each push their own gradients" in capsys.readouterr().err


def test_a_blocking_collective_pays_the_ranks_arriving_apart_as_measured_on_the_host():
    """collective_arrival constants (seconds per collective, by ranks and segment in ms, as one idle
    core runs it): read at the nearest rank count, interpolated in log segment, 0 where absent; under
    gloo every fully sharded unit's gather and reduce-scatter, and every tp all-reduce, pays it."""
    table = {arrival_key(2, 1.0): 0.001, arrival_key(2, 4.0): 0.002, arrival_key(4, 4.0): 0.003}
    hw = hardware(host_cores=2, **table)
    assert arrival_seconds(hw, 2, 0.002) == pytest.approx(0.0015)  # halfway between 1 and 4 ms in log
    assert arrival_seconds(hw, 2, 0.0005) == pytest.approx(0.0005)  # to 0 below the shortest
    assert arrival_seconds(hw, 2, 0.1) == pytest.approx(0.002)  # flat above the longest
    assert arrival_seconds(hw, 3, 0.1) == pytest.approx(0.003)  # the nearest count, the larger on a tie
    assert arrival_seconds(hw, 4, 0.008) == pytest.approx(0.003)  # 4 ranks on 2 cores: 4 ms a core
    assert arrival_seconds(hardware(host_cores=2), 2, 0.004) == 0.0
    plain, measured = hardware(inter_bw=1e9, host_cores=2), hardware(inter_bw=1e9, host_cores=2, **table)
    # full dp2: 3 units (the toy's 4 layers but one: the root's) x (gather, gather again, reduce-scatter),
    # segments of 0.24 s / 9, past the longest measured: 2 ms each
    plan = Plan(dp=2, shard="full")
    extra = estimate(model(), measured, plan, 40).step_s - estimate(model(), plain, plan, 40).step_s
    assert extra == pytest.approx(9 * 0.002)
    # tp2: 1 + 4 + 4 + 1 all-reduces a micro-batch (the toy's ends and middle layers), 2 ms each
    plan = Plan(tp=2)
    extra = estimate(model(), measured, plan, 40).step_s - estimate(model(), plain, plan, 40).step_s
    assert extra == pytest.approx(10 * 0.002)
    engine = Plan(dp=2)  # the engine's all-reduces run on a thread of their own: none blocks
    assert estimate(model(), measured, engine, 40).step_s == estimate(model(), plain, engine, 40).step_s
