"""Time to accuracy of every gradient compressor against torch DDP, variants taking turns in one group."""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

from paraloom.config.choices import COMPRESSORS

VARIANTS = ("ddp", "ddp_fp16", "wait_free", *COMPRESSORS, "powersgd_4", "topk_0.001", "dgc_0.001")
# name -> (compressor, options); DGC's momentum is set by `dgc_momentum` (it depends on the optimizer)
ENGINE_VARIANTS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "wait_free": (None, {}),
    **{name: (name, {}) for name in COMPRESSORS},
    "powersgd_4": ("powersgd", {"rank": 4, "start_iter": 2}),  # rank 4, compressed from the third step
    "topk_0.001": ("topk", {"density": 0.001}),
    # the paper's four warm-up densities, one step each (one epoch each would cost the wire ratio:
    # 25% density is 8 * 0.25 = 2 bytes per element, half of fp32)
    "dgc_0.001": ("dgc", {"density": 0.001, "warmup_steps": 4}),
}
MOMENTUM = 0.9  # of momentum SGD (optimizer="sgd")


def dgc_momentum(optimizer: str) -> float:
    """DGC's momentum correction replaces momentum SGD's own momentum (Lin et al. 2018); under Adam,
    which keeps its own moments, DGC runs without it (sampled top-k with error feedback)."""
    return MOMENTUM if optimizer == "sgd" else 0.0


def engine_variant(variant: str, optimizer: str) -> tuple[str | None, dict[str, Any]]:
    name, options = ENGINE_VARIANTS[variant]
    if name == "dgc":
        options = {**options, "momentum": dgc_momentum(optimizer)}
    return name, options


def bench_optimizer(params, optimizer: str, lr: float, dgc: bool = False):
    """Adam, or momentum SGD (without momentum when DGC's momentum correction takes its place)."""
    import torch

    if optimizer == "sgd":  # fused: one kernel over all parameters, the same for every variant
        return torch.optim.SGD(params, lr=lr, momentum=0.0 if dgc else MOMENTUM, fused=True)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, fused=True)
    raise ValueError(f"optimizer {optimizer!r}: choose adam or sgd")
CODEC_REPEATS = 3


def _model(hidden: int, depth: int):
    from paraloom.models import MLP

    return MLP((1, 8, 8), 10, hidden=hidden, depth=depth)


def _max(value: float) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def codec_seconds(variant: str, pieces: list, world: int, matrices: list | None = None,
                  optimizer: str = "adam") -> float:
    """Encode+decode seconds of one step's worth of pieces (see `measure`); PowerSGD's
    are its products and orthogonalizations on `matrices` (the gradients it compresses)."""
    import torch

    from paraloom.compress import make_compressor
    from paraloom.compress.powersgd import PowerSGDState
    from paraloom.data_parallel.compressed import decode_sum

    if variant == "ddp":
        return 0.0
    if variant == "ddp_fp16":  # what torch's fp16_compress_hook does around its all-reduce
        def once() -> None:
            for piece in pieces:
                piece.to(torch.float16).div_(world).to(torch.float32)
    elif variant.startswith("powersgd"):
        state = PowerSGDState(**{**ENGINE_VARIANTS[variant][1], "start_iter": 0})
        chosen = [m for m in matrices or [] if state.should_compress(m.shape)]

        def once() -> None:  # P = MQ, orth(P), Q = M^T P, P Q^T: the all-reduced sums stand in
            for key, m in enumerate(chosen):
                state.decompress(key, state.q_matrices(key, state.p_matrices(key, m)))
    else:
        name, options = engine_variant(variant, optimizer)
        if name is None:
            return 0.0
        compressor = make_compressor(name, **options)

        def once() -> None:
            for key, piece in enumerate(pieces):
                payload, ctx = compressor.compress(piece, key)
                if compressor.summable:
                    compressor.decompress(payload, ctx)
                else:  # the engine's decode of `world` gathered payloads
                    decode_sum(compressor, payload.expand(world, -1), ctx, torch.empty_like(piece))
    once()  # first call: allocations, error-feedback memory
    times = []
    for _ in range(CODEC_REPEATS):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(options: dict[str, Any], save) -> dict[str, Any]:
    """One rank's part: train every variant in turn and time it; `save` keeps each variant's figures.

    Every variant trains the same model (same seed, same initial weights) on the same digits shards
    in the same order, with Adam or momentum SGD, for `epochs` epochs; variants take turns in one
    process group.
    Per epoch, the training steps alone are timed (barrier before, `finish()` after, the slowest
    rank's time kept); test accuracy is evaluated after every epoch, outside the timed span.
    Time to accuracy (TTA) is the training time summed up to the end of the first epoch whose test
    accuracy reaches `target` (None if none does). Wire bytes per step are the payload bytes this
    rank hands to collectives: paraloom's `engine.stats.bytes` over the steps; for torch DDP, 4 bytes
    per parameter (fp32 all-reduce) or 2 (the fp16 hook), which is the same quantity. Encode+decode
    time per step is measured after training, apart from it: one compress of every bucket-sized
    piece of a real gradient plus the decodes a step does (one for an all-reduced payload, one per
    rank for an all-gathered one), median of a few repeats, slowest rank.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paraloom.data import ShardedBatches, load_dataset, split_datasets
    from paraloom.data_parallel import DataParallel
    from paraloom.topology import Topology
    from paraloom.train.loss_eval import batch_loss, evaluate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    split = load_dataset("digits")
    batches = ShardedBatches(len(split.y_train), options["batch"], rank=rank, world=world, seed=0)
    hidden, depth, epochs = options["hidden"], options["depth"], options["epochs"]

    groups = Topology.for_world(world).init_groups()

    # the two sides of a step: computation alone, one fp32 all-reduce of all gradients
    torch.manual_seed(0)
    bare = _model(hidden, depth)
    optimizer_name = options.get("optimizer", "adam")
    bare_optimizer = bench_optimizer(bare.parameters(), optimizer_name, options["lr"])
    n_params = sum(p.numel() for p in bare.parameters())
    first = next(iter(batches.epoch(0)))
    x0, y0, count0 = split.x_train[first[0]], split.y_train[first[0]], first[1]

    def local_step() -> None:
        bare_optimizer.zero_grad(set_to_none=False)
        batch_loss(bare, x0, y0, scale=world / count0)[0].backward()
        bare_optimizer.step()

    flat = torch.zeros(n_params)

    def probe(fn, n: int = 5) -> float:
        fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return _max((time.perf_counter() - start) / n)

    compute_s = probe(local_step)
    allreduce_s = probe(lambda: dist.all_reduce(flat))
    # a real gradient, for the codec timings
    bare_optimizer.zero_grad(set_to_none=False)
    batch_loss(bare, x0, y0, scale=world / count0)[0].backward()
    gradient = torch.cat([p.grad.reshape(-1) for p in bare.parameters()][::-1])
    matrices = [p.grad.clone() for p in bare.parameters() if p.dim() >= 2]

    results: dict[str, Any] = {}
    out = {"world_size": world, "params": n_params, "compute_s": compute_s, "allreduce_s": allreduce_s,
           "variants": results}
    for variant in options["variants"]:
        torch.manual_seed(0)
        model = _model(hidden, depth)
        is_ddp = variant.startswith("ddp")
        if is_ddp:
            engine = DDP(model, bucket_cap_mb=options["bucket_mb"])
            if variant == "ddp_fp16":
                engine.register_comm_hook(None, fp16_compress_hook)
        else:
            name, compressor_options = engine_variant(variant, optimizer_name)
            engine = DataParallel(model, bucket_mb=options["bucket_mb"], scheduler="wait_free",
                                  compressor=name, compressor_options=compressor_options)
            engine.stats.take()  # the initial broadcast is not a step's traffic
        optimizer = bench_optimizer(model.parameters(), optimizer_name, options["lr"],
                                    dgc=not is_ddp and ENGINE_VARIANTS[variant][0] == "dgc")
        per_epoch = sum(1 for _ in batches.epoch(0))
        schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * per_epoch)
                    if options.get("cosine") else None)
        evals = min(per_epoch, max(1, int(options.get("evals_per_epoch", 1))))
        marks = {round(per_epoch * (j + 1) / evals) for j in range(evals)}  # batches after which to test
        train_s, steps, accs, curve, tta, tta_steps = 0.0, 0, [], [], None, None
        for epoch in range(epochs):
            dist.barrier()
            start = time.perf_counter()
            for b, (idx, count) in enumerate(batches.epoch(epoch), 1):
                loss = batch_loss(engine, split.x_train[idx], split.y_train[idx], scale=world / count)[0]
                if is_ddp:
                    optimizer.zero_grad(set_to_none=False)
                    loss.backward()
                    optimizer.step()
                else:
                    loss.backward()
                    engine.step(optimizer)
                if schedule is not None:
                    schedule.step()
                steps += 1
                if b not in marks:
                    continue
                if not is_ddp:
                    engine.finish()
                train_s += _max(time.perf_counter() - start)
                acc = evaluate(model, split_datasets(split), groups.dp_group,
                               torch.device("cpu"))["test_accuracy"]  # outside the timed span
                curve.append([steps, train_s, acc])
                if tta is None and acc >= options["target"]:
                    tta, tta_steps = train_s, steps
                dist.barrier()
                start = time.perf_counter()
            accs.append(curve[-1][2])
        if is_ddp:
            wire = (4 if variant == "ddp" else 2) * n_params
            sizes = [n_params]  # DDP's buckets differ, but the casts cost the same per element
        else:
            wire = engine.stats.bytes / steps
            sizes = [bucket.buffer.numel() for bucket in engine.buckets]
            engine.close()
        pieces = list(gradient.split(sizes)) if sum(sizes) == n_params else [gradient]
        codec_s = _max(codec_seconds(variant, pieces, world, matrices, optimizer_name))
        results[variant] = {"train_s": train_s, "steps": steps, "step_s": train_s / steps,
                            "wire_bytes_per_step": wire, "wire_ratio": 4 * n_params / wire,
                            "accuracy": accs, "final_accuracy": accs[-1], "curve": curve, "tta_s": tta,
                            "tta_steps": tta_steps,
                            "tta_epochs": None if tta_steps is None else tta_steps / per_epoch,
                            "codec_s_per_step": codec_s}
        del engine, model, optimizer
        save(out)  # after every variant: a run that fails later keeps what it measured
    dist.destroy_process_group()
    return out


def run(*, cluster=None, nproc: int = 4, hidden: int = 1024, depth: int = 3, batch: int = 128,
        epochs: int = 10, lr: float = 1e-3, optimizer: str = "adam", cosine: bool = False,
        evals_per_epoch: int = 1, target: float = 0.93, bucket_mb: float = 25.0,
        variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Launch `measure` on `cluster` (one worker per node) or on `nproc` loopback workers."""
    from paraloom.bench.harness import PartialResults, launch

    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    options = {"hidden": hidden, "depth": depth, "batch": batch, "epochs": epochs, "lr": lr,
               "optimizer": optimizer, "cosine": cosine, "evals_per_epoch": evals_per_epoch,
               "target": target, "bucket_mb": bucket_mb, "variants": list(variants)}
    try:
        out = launch(f"{__name__}:measure", options, cluster=cluster, nproc=nproc,
                     prefix="paraloom-cmpbench-", keep_partial=True)[0]
    except PartialResults as failure:  # keep the variants measured before the failure
        if 0 not in failure.results:
            raise failure.error from None
        out = {**failure.results[0], "error": str(failure)}
    out["recipe"] = dict(options)
    return out
