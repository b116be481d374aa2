"""A user's own model, data set and recipe under every strategy: one process's losses and parameters.

The model and the data set are defined here, not in paraloom: a small transformer that lists its
pipeline pieces (it is not an nn.Sequential) with a fused q/k/v projection and a tensor-parallel
plan, and a map-style data set of token sequences. The recipe is a real one: AdamW, linear warm-up
then cosine decay, two accumulated micro-batches per step and a global-norm clip low enough that
it clips every step. The reference is a plain single-process torch loop written out below.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.testing import assert_close

from paraloom.config import load_config
from paraloom.data import DataSets, ShardedBatchSampler
from paraloom.optim import LAMB, LARS
from paraloom.train import train

VOCAB, SEQ, D, HEADS, N_SAMPLES = 32, 8, 16, 4, 70
STEPS, BATCH, LR, WARMUP, CLIP, WD = 5, 8, 0.01, 2, 0.05, 0.1
EPS = 1e-6  # Adam's eps: the key bias's gradient is zero up to rounding (softmax ignores a shift), and
# with eps=1e-8 Adam turns that rounding noise into updates of the order of lr
TOL = {"rtol": 2e-4, "atol": 2e-5}  # sums in another order (shards, micro-batches), 5 AdamW steps

torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # import torch._dynamo once, before forking


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Parameter(torch.randn(SEQ, D) * 0.02)

    def forward(self, x):
        return self.tok(x) + self.pos[: x.shape[1]]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.qkv, self.proj = HEADS, nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.logits = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, x):
        return self.logits(self.ln(x))


class TinyLM(nn.Module):
    """Not an nn.Sequential: it lists its pieces for pipeline parallelism."""

    def __init__(self, layers=2):
        super().__init__()
        self.embed, self.blocks, self.head = Embed(), nn.ModuleList(Block() for _ in range(layers)), Head()

    def pipeline_pieces(self):
        return [self.embed, *self.blocks, self.head]

    def forward(self, x):
        for piece in self.pipeline_pieces():
            x = piece(x)
        return x


class UnlistedLM(TinyLM):
    """The same model listing no pieces: tensor parallelism alone needs only its plan."""

    pipeline_pieces = None

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


TP_PLAN = {"embed.tok": "vocab", "blocks.*.attn.qkv": {"style": "colwise", "fused": 3, "heads": "n_heads"},
           "blocks.*.attn.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise",
           "head.logits": "colwise"}


def make_model(layers=2, listed=True):
    return (TinyLM if listed else UnlistedLM)(layers)


class Tokens(torch.utils.data.Dataset):
    """Sequences of a noisy counting pattern: predictable enough to learn, never constant."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        seq = (start + torch.arange(SEQ + 1)) % VOCAB
        noise = torch.rand(n, SEQ + 1, generator=g) < 0.2
        self.seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)

    def __len__(self):
        return len(self.seq)

    def __getitem__(self, i):
        return self.seq[i, :-1], self.seq[i, 1:]


def make_data(n=N_SAMPLES):
    return DataSets(Tokens(n, 1), Tokens(24, 2), loss="next_token")


SETTINGS = [f"model.name={__name__}:make_model", f"data.name={__name__}:make_data",
            f"data.batch_size={BATCH}", "optim.name=adamw", f"optim.options.eps={EPS}", f"optim.lr={LR}",
            f"optim.weight_decay={WD}", "optim.schedule=cosine",
            f"optim.warmup_steps={WARMUP}", "optim.accumulate=2", f"optim.clip_norm={CLIP}",
            f"optim.max_steps={STEPS}", "run.log_every=1", "run.checkpoint_every=0", "comm.timeout_s=60"]


def _factor(step):
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1.0 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def reference(optimizer_name="adamw", no_decay=(), smoothing=0.0, ema=None, options=None):
    """One process, plain torch (paraloom's LAMB, tested against the paper elsewhere): per-step mean
    losses, the gradient norms before clipping, and the final parameters. `no_decay`: names of
    parameters in a group of their own without weight decay, as a user's script would write it;
    `smoothing`: the loss's label smoothing; `ema`: the decay of torch's AveragedModel EMA, whose
    final state is returned fourth."""
    torch.manual_seed(0)
    model, data = make_model(), make_data()
    make = {"adamw": torch.optim.AdamW, "lamb": LAMB, "lars": LARS}[optimizer_name]
    params = model.parameters()
    if no_decay:
        named = list(model.named_parameters())
        params = [{"params": [p for n, p in named if n not in no_decay]},
                  {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}]
    optimizer = make(params, lr=LR, weight_decay=WD, eps=EPS, **(options or {}))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _factor)
    averaged = None if ema is None else torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(ema), use_buffers=True)
    sampler = ShardedBatchSampler(len(data.train), BATCH, rank=0, world=1, seed=0)
    sampler.set_epoch(0)
    losses, norms = [], []
    for indices in list(sampler)[:STEPS]:
        x = torch.stack([data.train[i][0] for i in indices])
        y = torch.stack([data.train[i][1] for i in indices])
        total = 0.0
        for xs, ys in zip(x.tensor_split(2), y.tensor_split(2), strict=True):  # two accumulated halves
            out = model(xs)
            loss = F.cross_entropy(out.reshape(-1, VOCAB), ys.reshape(-1), reduction="sum",
                                   label_smoothing=smoothing) / SEQ / len(x)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(total)
        if averaged is not None:
            averaged.update_parameters(model)
    if averaged is not None:
        return losses, norms, model.state_dict(), averaged.module.state_dict()
    return losses, norms, model.state_dict()


def _train(rank, world, overrides, run_dir, plan):
    cfg = load_config(None, SETTINGS + list(overrides))
    cfg.model.tp_plan = plan  # a mapping of mappings: what a YAML config gives (see examples/)
    cfg.validate_world(world)
    return train(cfg, run_dir if rank == 0 else None, device=torch.device("cpu"))


STRATEGIES = {  # name: (processes, settings)
    "dp2": (2, []),
    "ps_bsp_2workers": (4, ["parallel.mode=ps", "ps.consistency=bsp", "ps.servers=2",
                            "ps.partition_mb=0.01"]),  # slices on two server processes: one norm
    "pp2_1f1b": (2, ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=1f1b"]),
    "pp2_gpipe": (2, ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=gpipe"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_unlisted": (2, ["parallel.tp=2", "model.options.listed=false"]),
    "dp2_tp2": (4, ["parallel.tp=2"]),
    "dp2_pp2": (4, ["parallel.pp=2", "parallel.microbatches=2"]),
    "dp2_shard_optimizer": (2, ["comm.shard_optimizer=true"]),
    "dp2_full": (2, ["parallel.shard=full"]),  # units: the ModuleList's blocks
    "dp4_hybrid": (4, ["parallel.shard=hybrid", "parallel.shard_group=2", "parallel.shard_units=Block,Head"]),
    "dp2_tp2_full": (4, ["parallel.tp=2", "parallel.shard=full"]),  # the test's tp plan, then sharded
    "dp2_pp2_full": (4, ["parallel.pp=2", "parallel.microbatches=2", "parallel.shard=full"]),  # its stages
}


@pytest.fixture(scope="module")
def expected():
    return reference()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_user_model_and_data_train_like_one_process(name, expected, tmp_path):
    losses, norms, params = expected
    assert min(norms) > 2 * CLIP  # clipping acts on every step compared
    world, overrides = STRATEGIES[name]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = TP_PLAN if "parallel.tp=2" in overrides else None
    run_workers(_train, world, overrides, run_dir, plan, timeout=120)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_close([row["loss"] for row in logged], losses, **TOL)
    saved = torch.load(run_dir / "model.pt", weights_only=True)
    assert saved.keys() == params.keys()
    for key, value in params.items():
        assert_close(saved[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", ["dp2_shard_optimizer", "tp2", "dp2_full", "dp2_pp2_full"])
def test_lamb_trust_ratios_are_of_whole_tensors_when_a_rank_holds_a_piece(name, tmp_path):
    """LAMB scales each tensor's update by a ratio of that whole tensor's norms: under the sharded
    optimizer a rank steps blocks of flat buffers that cut tensors apart, under tp a rank holds a
    slice of each split tensor, fully sharded a row block of each (with pipeline stages, of its stage's
    tensors); either way the norms are summed over the ranks (optim/trust.py)."""
    losses, _, params = reference("lamb")
    world, overrides = STRATEGIES[name]
    plan = TP_PLAN if "parallel.tp=2" in overrides else None
    run_workers(_train, world, [*overrides, "optim.name=lamb"], tmp_path, plan, timeout=120)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_close([row["loss"] for row in logged], losses, **TOL)
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    for key, value in params.items():
        assert_close(saved[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", ["dp2_full", "dp2_tp2_full"])
def test_lars_trust_ratios_are_of_whole_tensors_on_fully_sharded_row_blocks(name, tmp_path):
    """LARS (momentum 0.9, the config's) on the shards of a fully sharded run: each tensor's ratio is of
    the whole tensor, its row blocks' squared norms summed over the sharding group, and for a tp slice
    then over the tp group (optim/trust.py). eta 1 (not LARS's 1e-3) so that the ratios move the weights
    by a percent a step: a ratio of a shard's own norms would then show (checked: with the shards' sums
    kept local, or a tp slice's not summed over the tp group, this test fails)."""
    losses, _, params = reference("lars", options={"eta": 1.0})
    world, overrides = STRATEGIES[name]
    plan = TP_PLAN if "parallel.tp=2" in overrides else None
    run_workers(_train, world, [*overrides, "optim.name=lars", "optim.options.eta=1.0"], tmp_path, plan,
                timeout=120)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_close([row["loss"] for row in logged], losses, **TOL)
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    for key, value in params.items():
        assert_close(saved[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", ["dp2", "tp2", "pp2_1f1b", "ps_bsp_2workers", "dp2_full"])
def test_no_decay_groups_label_smoothing_and_ema_train_like_a_script(name, expected, tmp_path):
    """optim.no_decay="1d,embed.pos": every bias and norm scale and one 2-D parameter by name train
    without weight decay, as two parameter groups in a plain script do; under tensor parallelism the
    split layers' new parameters are marked again, and a pipeline stage keeps the whole model's names.
    optim.label_smoothing=0.1 as F.cross_entropy's, also of tensor parallelism's vocabulary-split logits.
    optim.ema=0.8: model_ema.pt is torch's AveragedModel EMA of the weights, gathered from the ranks.
    The parameter server refuses no_decay and ema (its weights live on the servers, in slices that cut
    across parameters): smoothing alone there."""
    named = dict(make_model().named_parameters())
    ps = name.startswith("ps")
    exempt = set() if ps else {n for n, p in named.items() if p.dim() < 2 or n == "embed.pos"}
    losses, _, params, *ema = reference(no_decay=exempt, smoothing=0.1, ema=None if ps else 0.8)
    world, overrides = STRATEGIES[name]
    plan = TP_PLAN if "parallel.tp=2" in overrides else None
    extra = ["optim.label_smoothing=0.1"] + ([] if ps else ["optim.no_decay=1d,embed.pos", "optim.ema=0.8"])
    run_workers(_train, world, [*overrides, *extra], tmp_path, plan, timeout=120)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_close([row["loss"] for row in logged], losses, **TOL)
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    for key, value in params.items():
        assert_close(saved[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")
    decayed = expected[2]  # the same run with every parameter decayed ends elsewhere
    assert ps or any(not torch.allclose(saved[key], decayed[key], **TOL) for key in exempt)
    unsmoothed = reference(no_decay=exempt)[0]  # and without smoothing its losses are others
    assert not torch.allclose(torch.tensor(unsmoothed), torch.tensor(losses), **TOL)
    if ema:
        averaged = torch.load(tmp_path / "model_ema.pt", weights_only=True)
        assert averaged.keys() == ema[0].keys()
        for key, value in ema[0].items():
            assert_close(averaged[key], value, **TOL, msg=lambda m, key=key: f"ema {key}: {m}")
        assert any(not torch.allclose(averaged[k], saved[k], **TOL) for k in saved)  # not the weights
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert 0 <= summary["ema_test_accuracy"] <= 1 and summary["ema_val_loss"] > 0
