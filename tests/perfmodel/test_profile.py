"""Model profiles: FLOPs and bytes per layer against hand-computed values and real runs; spec parsing."""

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from paraloom.config.errors import UserError
from paraloom.perfmodel import build_from_spec, profile_model
from paraloom.perfmodel.model_profile import OP_CLASSES

GPT_SMALL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256"
GPT_175B = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"


def _n_params(spec: str) -> int:
    model, _ = build_from_spec(spec)
    return sum(p.numel() for p in model.parameters())


def test_linear_forward_is_2_in_out_and_backward_twice_that():
    p = profile_model("mlp:input=784,hidden=256,depth=2,classes=10")  # Flatten, (Linear, ReLU) x 2, Linear
    first, hidden, last = p.layers[1], p.layers[3], p.layers[5]
    assert first.fwd_flops["matmul"] == 2 * 784 * 256  # per sample: 2 * B * in * out with B = 1
    assert hidden.fwd_flops["matmul"] == 2 * 256 * 256
    assert last.fwd_flops["matmul"] == 2 * 256 * 10
    assert hidden.bwd_flops["matmul"] == 2 * hidden.fwd_flops["matmul"]  # grad input + grad weight
    assert last.bwd_flops["matmul"] == 2 * last.fwd_flops["matmul"]
    assert first.bwd_flops["matmul"] == first.fwd_flops["matmul"]  # the data needs no gradient
    assert p.layers[0].fwd_flops == dict.fromkeys(OP_CLASSES, 0.0)  # Flatten is a view
    assert p.layers[2].fwd_flops["other"] == 256  # ReLU: one FLOP per element written


def test_gpt_block_flops_match_the_transformer_formula():
    """Per block and sequence (B = 1): 24*B*T*d^2 matmul FLOPs (qkv 6, proj 2, MLP 16 * B*T*d^2) plus
    4*B*T^2*d attention FLOPs (Q K^T and A V, counted without the causal mask, as torch's counter does)."""
    t, d, h = 32, 64, 4
    block = profile_model(f"gpt:layers=2,hidden={d},heads={h},seq={t},vocab=256").layers[1]
    assert block.fwd_flops["matmul"] == 24 * t * d**2
    assert block.fwd_flops["attention"] == 4 * t**2 * d
    assert block.bwd_flops["matmul"] == 2 * block.fwd_flops["matmul"]
    assert block.bwd_flops["attention"] == 2.5 * block.fwd_flops["attention"]  # flash recomputes the scores
    assert block.fwd_flops["conv"] == 0 and block.fwd_flops["other"] > 0


def test_gpt_block_activation_bytes_by_hand():
    """Saved per token, in d-wide units: block input, ln1 out, qkv (3; q, k, v are views), attention out (its
    transposed reshape is a view), residual, ln2 out, fc out (4), gelu out (4) = 16 d values, plus fp32
    statistics: mean and rstd of two layer norms (16 bytes) and the attention's log-sum-exp per head.

    Under bf16 autocast the residual stream stays fp32 (block input and residual: 2 x 4 bytes) and the
    layer norms' outputs are saved as the bf16 copies the linears cast them to: 8 + 14 x 2 = 36 bytes."""
    t, d, h = 32, 64, 4
    for dtype, per_token, stream in (("fp32", 16 * 4, 4), ("bf16", 2 * 4 + 14 * 2, 4)):
        block = profile_model(f"gpt:layers=2,hidden={d},heads={h},seq={t},vocab=256", dtype=dtype).layers[1]
        assert block.activation_bytes == t * (per_token * d + 16 + 4 * h)
        assert block.input_saved_bytes == t * d * stream and block.output_bytes == t * d * stream


def _saved_per_sample(model, make, run) -> float:
    """Bytes a real CPU run of `run(make(batch))` saves for backward per sample (the slope from 2 to
    4; what `make` saves is not counted), parameters left out, as the profile counts them."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []
    for batch in (2, 4):
        storages: dict[int, int] = {}

        def pack(t, storages=storages):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        inputs = make(batch)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(inputs)
        saved.append(sum(storages.values()))
    return (saved[1] - saved[0]) / 2


def test_gpt_activation_bytes_match_a_real_cpu_run():
    torch.manual_seed(0)
    model, make_input = build_from_spec(GPT_SMALL, device="cpu")

    def run(x):
        out = model(x)
        target = torch.zeros(out.shape[:-1], dtype=torch.long)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction="sum")

    assert profile_model(GPT_SMALL).activation_bytes() == _saved_per_sample(model, make_input, run)


def test_the_emulated_autocast_saves_what_torchs_autocast_saves():
    """On the meta device the profile casts as autocast does (perfmodel/measure/autocast.py); a real run of
    the blocks under torch.autocast on the CPU saves the same bytes per sample."""
    torch.manual_seed(0)
    model, make_input = build_from_spec(GPT_SMALL, device="cpu")
    blocks = nn.Sequential(*list(model.children())[1:-1])

    def embedded(batch):
        return model[0](make_input(batch)).detach().requires_grad_()

    def run(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            blocks(x)

    profiled = profile_model(GPT_SMALL, dtype="bf16")
    measured = _saved_per_sample(model, embedded, run)
    assert sum(layer.activation_bytes for layer in profiled.layers[1:-1]) == measured


@pytest.mark.parametrize("spec", ["mlp:input=784,hidden=64,depth=3,classes=10", "cnn", "vgg16:input=3x32x32",
                                  "resnet18:input=3x32x32,classes=10"])
def test_flops_by_class_match_flop_counter_mode_on_the_whole_model(spec):
    model, make_input = build_from_spec(spec)
    with FlopCounterMode(display=False) as counter:
        model(make_input(2)).sum().backward()
    p = profile_model(spec)
    fwd, bwd = p.flops_by_class("fwd"), p.flops_by_class("bwd")
    counted = sum(fwd[c] + bwd[c] for c in ("matmul", "conv", "attention"))
    assert counted == counter.get_total_flops() / 2


ZOO_SPECS = ["mlp", "cnn", "resnet18", "resnet50", "resnet101", "resnet152", "vgg16", "alexnet", "googlenet",
             "inception_v3", GPT_SMALL, "bert:layers=2,hidden=64,heads=4,seq=32,vocab=256",
             "vgg16:input=1x8x8,classes=10,batch_norm=true", "gpt"]


@pytest.mark.parametrize("spec", ZOO_SPECS)
def test_parameter_counts_equal_the_real_model(spec):
    assert profile_model(spec).n_params == _n_params(spec)


def test_resnet101_at_imagenet_size():
    p = profile_model("resnet101")
    assert p.n_params == 44_549_160
    assert len(p.layers) == 1 + 33 + 1
    multiply_adds = (p.flops_by_class("fwd")["conv"] + p.flops_by_class("fwd")["matmul"]) / 2
    assert abs(multiply_adds - 7.80e9) < 0.01e9  # torchvision's table: "GFLOPS 7.80", counting multiply-adds
    assert p.input_bytes == 3 * 224 * 224 * 4  # fp32 image as loaded


def test_mixed_precision_keeps_fp32_weights_and_gradients_and_adds_autocasts_copies():
    """Autocast trains fp32 weights: their gradients are fp32, the fp32 weights count with the
    optimizer's state, and `param_bytes` is the low-precision copies the forward casts them to."""
    fp32, fp16 = profile_model(GPT_SMALL), profile_model(GPT_SMALL, dtype="fp16")
    n = fp32.n_params
    assert fp16.param_bytes == fp32.param_bytes / 2 == 2 * n
    assert fp16.grad_bytes == fp32.grad_bytes == 4 * n
    assert fp32.optimizer_bytes("adam") == 8 * n and fp32.optimizer_bytes("sgd") == 0
    assert fp32.optimizer_bytes("momentum") == 4 * n
    total = fp16.param_bytes + fp16.grad_bytes + fp16.optimizer_bytes("adam")
    assert total == 18 * n  # ZeRO's 16 bytes of mixed-precision Adam, with fp32 gradients instead of fp16
    assert fp16.activation_bytes() < 0.75 * fp32.activation_bytes()
    assert fp16.flops_by_class("fwd")["matmul"] == fp32.flops_by_class("fwd")["matmul"]


def test_full_recompute_trades_activation_bytes_for_a_second_forward():
    none = profile_model("gpt:layers=8,hidden=64,heads=4,seq=32,vocab=256")
    full = profile_model("gpt:layers=8,hidden=64,heads=4,seq=32,vocab=256", recompute="full")
    assert full.activation_bytes() < none.activation_bytes() / 3
    assert none.recompute_flops() == 0 and full.recompute_flops() == full.fwd_flops() == none.fwd_flops()
    assert full.bwd_flops() == none.bwd_flops()
    kept = full.input_bytes + sum(layer.output_bytes for layer in full.layers[:-1])
    largest = max(layer.activation_bytes - layer.input_saved_bytes for layer in full.layers)
    assert full.activation_bytes() == kept + largest
    assert none.activation_bytes("full") == full.activation_bytes()


def test_slices_are_pipeline_stages():
    p = profile_model(GPT_SMALL)
    first, second = p.slice(0, 2), p.slice(2, 4)
    assert first.fwd_flops() + second.fwd_flops() == p.fwd_flops()
    assert first.n_params + second.n_params == p.n_params
    assert first.input_bytes == p.input_bytes == 32 * 8  # int64 tokens
    assert second.input_bytes == p.layers[1].output_bytes == 32 * 64 * 4  # what stage 1 receives
    assert first.output_bytes == second.input_bytes
    with pytest.raises(UserError, match="choose 0 <= start < stop <= 4"):
        p.slice(3, 3)


def test_175b_gpt_profiles_in_seconds():
    start = time.perf_counter()
    p = profile_model(GPT_175B, dtype="bf16")
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"profiling the 175B GPT took {elapsed:.1f} s"
    assert len(p.layers) == 96 + 2
    assert 174e9 < p.n_params < 176e9
    per_token = p.fwd_flops() / 2048
    assert 2 * p.n_params < per_token < 1.1 * 2 * p.n_params  # about 2N per token (Kaplan et al. 2020)
    assert p.param_bytes + p.grad_bytes + p.optimizer_bytes() == 18 * p.n_params  # bf16 autocast


def test_models_that_are_not_sequences_are_one_layer(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Twin(nn.Module):\n"
        "    def __init__(self, width):\n"
        "        super().__init__()\n"
        "        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)\n\n"
        "    def forward(self, x):\n"
        "        return self.a(x) + self.b(x)\n\n"
        "    def example_input(self, batch):\n"
        "        return torch.randn(batch, self.a.in_features)\n\n"
        "def make(width=8):\n"
        "    return Twin(width)\n\n"
        "def make_pair(width=8):\n"
        "    return nn.Sequential(nn.Linear(width, 3)), lambda batch: torch.randn(batch, width)\n\n"
        "def make_bare():\n"
        "    return nn.Linear(2, 2)\n\n"
        "class Split(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x, x\n\n"
        "def make_split():\n"
        "    return nn.Sequential(Split(), nn.Identity()), lambda batch: torch.randn(batch, 4)\n\n"
        "class Reader(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x * float(x.sum())\n\n"
        "def make_reader():\n"
        "    return nn.Sequential(Reader()), lambda batch: torch.randn(batch, 4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    twin = profile_model("usermodels:make:width=16")
    assert [layer.name for layer in twin.layers] == ["Twin"]
    # two linears (addmm folds the bias in), one add, and the loss's log-softmax over the 16 outputs
    assert twin.fwd_flops() == 2 * (2 * 16 * 16) + 16 + 16
    assert twin.n_params == 2 * (16 * 16 + 16)
    pair = profile_model("usermodels:make_pair")
    assert pair.layers[0].fwd_flops["matmul"] == 2 * 8 * 3
    with pytest.raises(UserError, match="takes no option 'depth'"):
        profile_model("usermodels:make:depth=3")
    with pytest.raises(UserError, match="has no attribute"):
        profile_model("usermodels:missing")
    with pytest.raises(UserError, match="needs an example input; give --data"):
        profile_model("usermodels:make_bare")
    with pytest.raises(UserError, match="gets a tuple, not a tensor"):
        profile_model("usermodels:make_split")
    with pytest.raises(UserError, match="cannot run on the meta device"):
        profile_model("usermodels:make_reader")




def test_a_user_model_takes_its_input_from_the_data_set_and_is_profiled_piece_by_piece(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # own_code.py: a user's model and data set
    profile = profile_model("own_code:make_model:width=32", data="own_code:make_data:n=5")
    assert [layer.name for layer in profile.layers] == ["stem", "body", "head"]
    assert profile.n_params == (4 * 32 + 32) + (32 * 32 + 32) + (32 * 3 + 3)
    assert profile.input_bytes == 4 * 4  # four fp32 features a sample
    with pytest.raises(UserError, match="takes no option 'rows'"):
        profile_model("own_code:make_model", data="own_code:make_data:rows=5")


@pytest.mark.parametrize(("spec", "message"), [
    ("lenet", "package.module:factory"),
    ("gpt:layers=2,depth=3", "choose from seq, vocab, layers, hidden, heads"),
    ("gpt:layers=two", "layers=.two. must be a whole number"),
    ("gpt:layers=2.5", "must be a whole number"),
    ("gpt:layers=0", "must be positive"),
    ("gpt:recompute=true", "recompute='full'"),
    ("gpt:layers=2,layers=3", "give it once"),
    ("gpt:layers", "must look like key=value"),
    ("gpt:hidden=64,heads=5", "choose n_heads in"),
    ("resnet50:input=3x0x9", "positive integers"),
    ("mlp:classes=0", "positive whole number"),
    ("no_such_package.models:make", "cannot import"),
    ("", "model spec is empty"),
    ("gpt layers", "not understood"),
])
def test_spec_errors_say_what_to_do(spec, message):
    with pytest.raises(UserError, match=message):
        profile_model(spec)


def test_options_are_checked():
    with pytest.raises(UserError, match="choose one of: fp32, fp16, bf16"):
        profile_model("mlp", dtype="fp8")
    with pytest.raises(UserError, match="choose one of: none, selective, full"):
        profile_model("mlp", recompute="some")
    with pytest.raises(UserError, match="choose one of: sgd, momentum, adam"):
        profile_model("mlp").optimizer_bytes("lamb")


def test_spec_builds_a_real_model_and_input():
    model, make_input = build_from_spec("gpt:layers=1,hidden=32,heads=2,seq=8,vocab=50", device="cpu")
    x = make_input(3)
    assert x.dtype == torch.int64 and x.shape == (3, 8) and int(x.max()) < 50
    assert model(x).shape == (3, 8, 50)
    model, make_input = build_from_spec("resnet18:input=1x8x8,classes=10,width=8", device="cpu")
    assert model(make_input(2)).shape == (2, 10)


def test_the_profile_tells_the_convolutions_winograd_takes():
    """3x3 stride-1 convolutions, forward and backward: all of VGG-16's, AlexNet's last three (a
    little over half its convolution FLOPs), the middle one of each ResNet-50 bottleneck."""
    def share(spec):
        p = profile_model(spec)
        return [sum(getattr(layer, f"{phase}_winograd") for layer in p.layers)
                / sum(getattr(layer, f"{phase}_flops")["conv"] for layer in p.layers)
                for phase in ("fwd", "bwd")]

    assert share("vgg16") == [1.0, 1.0]
    assert all(0.5 < s < 0.6 for s in share("alexnet"))
    assert all(0.3 < s < 0.45 for s in share("resnet50"))
    assert all(layer.fwd_winograd == 0 for layer in profile_model(GPT_SMALL).layers)
    # and the 5x5 stride-1 ones apart: AlexNet's second convolution, about a third of its conv FLOPs;
    # none in VGG-16
    alexnet, vgg = profile_model("alexnet"), profile_model("vgg16")
    five = sum(layer.fwd_winograd5 for layer in alexnet.layers)
    assert 0.3 < five / sum(layer.fwd_flops["conv"] for layer in alexnet.layers) < 0.4
    assert sum(layer.fwd_winograd5 + layer.bwd_winograd5 for layer in vgg.layers) == 0


def test_selective_recompute_is_profiled_as_the_model_runs_it():
    """The profile builds the gpt with its attention core recomputed: backward repeats the core's
    forward, and memory keeps no T x T scores with the math path and about the same with the
    fused kernel (which keeps none to begin with)."""
    spec = "gpt:layers=2,hidden=64,heads=4,seq=128,vocab=256,attention={}"
    math_none, math_sel = (profile_model(spec.format("math"), recompute=r) for r in ("none", "selective"))
    sdpa_none, sdpa_sel = (profile_model(spec.format("sdpa"), recompute=r) for r in ("none", "selective"))
    scores = 2 * 4 * 128 * 128 * 4  # the probabilities the two layers save per sample (4 heads, fp32)
    assert math_none.activation_bytes() - math_sel.activation_bytes() >= scores
    fused = sdpa_none.activation_bytes()
    assert abs(fused - sdpa_sel.activation_bytes()) < 0.05 * fused
    attention = sdpa_none.flops_by_class("fwd")["attention"]
    assert sdpa_sel.flops_by_class("bwd")["attention"] == pytest.approx(
        sdpa_none.flops_by_class("bwd")["attention"] + attention)
    assert sdpa_sel.recompute_flops() == 0  # inside backward's own count, not added again
    with pytest.raises(UserError, match="recomputes a transformer's attention core"):
        profile_model("mlp", recompute="selective")
