"""Reference models: each builds without memory and gives the right output shapes and parameter counts."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paraloom.config.errors import UserError
from paraloom.models import MODELS, build_model

# name -> (input shape, n_classes) of a small real example
SMALL = {
    "cnn": ((1, 8, 8), 10),
    "mlp": ((1, 8, 8), 10),
    "resnet18": ((1, 8, 8), 10),
    "resnet50": ((1, 8, 8), 10),
    "resnet101": ((1, 8, 8), 10),
    "resnet152": ((1, 8, 8), 10),
    "vgg16": ((1, 8, 8), 10),
    "alexnet": ((1, 8, 8), 10),
    "googlenet": ((3, 32, 32), 10),  # the smallest images they take
    "inception_v3": ((3, 75, 75), 10),
    "gpt": ((16,), 256),
    "bert": ((16,), 256),
}
# keeps the real forward passes of the deep models fast on two cores; the shapes do not depend on it
NARROW = {"width": 8, "fc_width": 16, "n_layers": 2, "d_model": 32, "n_heads": 4}


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _small_input(name: str) -> torch.Tensor:
    shape, n_classes = SMALL[name]
    if name in ("gpt", "bert"):
        return torch.randint(0, n_classes, (2, *shape))
    return torch.randn(2, *shape)


def _expected_shape(name: str) -> tuple[int, ...]:
    shape, n_classes = SMALL[name]
    return (2, shape[0], n_classes) if name in ("gpt", "bert") else (2, n_classes)


def test_every_model_is_covered():
    assert set(MODELS) == set(SMALL)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_builds_on_meta_without_memory(name):
    shape, n_classes = SMALL[name]
    with torch.device("meta"):
        model = build_model(name, shape, n_classes)
        x = _small_input(name)
        y = model(x)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert y.is_meta and tuple(y.shape) == _expected_shape(name)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_forward_shape_on_cpu(name):
    torch.manual_seed(0)
    shape, n_classes = SMALL[name]
    model = build_model(name, shape, n_classes, **NARROW)
    y = model(_small_input(name))
    assert tuple(y.shape) == _expected_shape(name)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet101", "vgg16", "alexnet"])
@pytest.mark.parametrize("shape", [(3, 32, 32), (3, 64, 64), (3, 9, 13)])
def test_image_models_take_other_sizes(name, shape):
    model = build_model(name, shape, 7, **NARROW)
    y = model(torch.randn(2, *shape))
    assert tuple(y.shape) == (2, 7)
    y.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("name", "expected"), [("resnet18", 11_689_512), ("resnet50", 25_557_032),
                                                ("resnet101", 44_549_160), ("resnet152", 60_192_808),
                                                ("vgg16", 138_357_544), ("alexnet", 61_100_840),
                                                ("googlenet", 6_624_904), ("inception_v3", 23_834_568)])
def test_imagenet_parameter_counts_match_torchvision(name, expected):
    with torch.device("meta"):
        model = build_model(name, (3, 224, 224), 1000)
        y = model(torch.empty(2, 3, 224, 224))
    assert _n_params(model) == expected
    assert tuple(y.shape) == (2, 1000)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet101"])
def test_resnet_stem_follows_image_size(name):
    with torch.device("meta"):
        small, large = build_model(name, (3, 32, 32), 10), build_model(name, (3, 224, 224), 10)
    assert small[0][0].kernel_size == (3, 3) and small[0][0].stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in small[0])
    assert large[0][0].kernel_size == (7, 7) and large[0][0].stride == (2, 2)
    assert any(isinstance(m, nn.MaxPool2d) for m in large[0])


def test_models_are_sequences_of_coarse_pieces():
    with torch.device("meta"):
        assert len(build_model("resnet18", (3, 32, 32), 10)) == 1 + 8 + 1  # stem, blocks, head
        assert len(build_model("resnet50", (3, 32, 32), 10)) == 1 + 16 + 1
        assert len(build_model("resnet101", (3, 32, 32), 10)) == 1 + 33 + 1
        assert len(build_model("vgg16", (3, 32, 32), 10)) == 13 + 3  # convolutions, classifier


def test_vgg_skips_pools_below_one_pixel_and_narrows_classifier():
    with torch.device("meta"):
        digits = build_model("vgg16", (1, 8, 8), 10)
        imagenet = build_model("vgg16", (3, 224, 224), 10)
    assert sum(isinstance(m, nn.MaxPool2d) for m in digits.modules()) == 3  # 8 -> 4 -> 2 -> 1
    assert sum(isinstance(m, nn.MaxPool2d) for m in imagenet.modules()) == 5
    assert [m.out_features for m in digits.modules() if isinstance(m, nn.Linear)] == [512, 512, 10]
    assert [m.out_features for m in imagenet.modules() if isinstance(m, nn.Linear)] == [4096, 4096, 10]


def _gpt_step(recompute: bool | str, attention: str = "sdpa", seq: int = 16):
    torch.manual_seed(0)
    model = build_model("gpt", (seq,), 256, n_layers=2, d_model=32, n_heads=4, recompute=recompute,
                        attention=attention)
    x = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], sum(storages.values())


def test_gpt_recompute_gives_same_loss_and_gradients_with_fewer_saved_bytes():
    loss, grads, saved = _gpt_step(recompute=False)
    loss_rc, grads_rc, saved_rc = _gpt_step(recompute=True)
    torch.testing.assert_close(loss_rc, loss)
    torch.testing.assert_close(grads_rc, grads)
    assert saved_rc < saved / 2


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_selective_recompute_gives_the_same_step_and_with_math_attention_saves_the_scores(attention):
    """Selective recomputation (the attention core alone, Korthikanti et al. 2022) changes nothing a
    step computes; it saves the T x T scores and probabilities where the math path keeps them, and
    next to nothing with the fused kernel, which keeps none."""
    loss, grads, saved = _gpt_step("none", attention, seq=64)
    loss_sel, grads_sel, saved_sel = _gpt_step("selective", attention, seq=64)
    torch.testing.assert_close(loss_sel, loss, rtol=0, atol=0)
    torch.testing.assert_close(grads_sel, grads, rtol=0, atol=0)
    scores = 2 * 2 * 4 * 64 * 64 * 4  # probabilities and masked scores: 2 layers x batch 2 x 4 heads, fp32
    if attention == "math":
        assert saved - saved_sel >= scores
    else:
        assert saved - saved_sel < scores / 4
    assert _gpt_step(True, attention, seq=64)[2] == _gpt_step("full", attention, seq=64)[2]  # true is full


def test_math_attention_equals_the_fused_kernel():
    loss, grads, _ = _gpt_step("none", "sdpa")
    loss_math, grads_math, _ = _gpt_step("none", "math")
    torch.testing.assert_close(loss_math, loss)
    torch.testing.assert_close(grads_math, grads, atol=1e-6, rtol=1e-4)


def test_gpt_refuses_unknown_recompute_and_attention_in_one_line():
    with pytest.raises(UserError, match="recompute='some' is not known; choose one of: none, selective"):
        build_model("gpt", (16,), 256, recompute="some")
    with pytest.raises(UserError, match="attention='flash' is not known; choose one of: sdpa, math"):
        build_model("gpt", (16,), 256, attention="flash")


def test_gpt_rejects_images():
    with pytest.raises(UserError, match="data.name=text"):
        build_model("gpt", (1, 8, 8), 10)


def test_gpt_rejects_heads_not_dividing_width():
    with pytest.raises(UserError, match="choose n_heads in"):
        build_model("gpt", (16,), 256, d_model=32, n_heads=5)


@pytest.mark.parametrize("name", ["cnn", "resnet18", "resnet50", "resnet101", "vgg16"])
def test_image_models_reject_sequences(name):
    with pytest.raises(UserError, match="channels, height, width"):
        build_model(name, (16,), 256)


def test_unknown_model_lists_the_names():
    with pytest.raises(UserError, match="resnet18"):
        build_model("lenet", (3, 32, 32), 10)


def test_llama_style_has_llama_2_7bs_parameter_count():
    from paraloom.perfmodel.measure.profile import profile_model
    from paraloom.perfmodel.measure.specs import build_from_spec

    spec = "gpt:layers=32,hidden=4096,heads=32,seq=4096,vocab=32000,style=llama,ffn=11008"
    model, _ = build_from_spec(spec, "meta")
    assert _n_params(model) == 6_738_415_616  # Touvron et al. 2023, Llama 2 7B (untied head)
    assert model.style == "llama" and model[0].pos is None and isinstance(model[1].ln1, nn.RMSNorm)
    assert model[1].attn.qkv.bias is None and model[1].mlp.fc.out_features == 2 * 11008
    assert profile_model("gpt:layers=2,hidden=64,heads=4,seq=32,style=llama").n_params == _n_params(
        build_from_spec("gpt:layers=2,hidden=64,heads=4,seq=32,style=llama", "meta")[0])


def test_rotary_positions_make_scores_depend_on_the_offset_only():
    from paraloom.models.gpt import llama_ffn, rotate

    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8)
    scores = rotate(q)[0, 0] @ rotate(k)[0, 0].T  # the same query and key at every position
    for offset in range(-5, 6):
        diagonal = torch.diagonal(scores, offset)
        assert torch.allclose(diagonal, diagonal[0].expand_as(diagonal), atol=1e-5)
    assert torch.allclose(rotate(q).norm(dim=-1), q.norm(dim=-1))
    assert llama_ffn(4096) == 11008 and llama_ffn(128) == 512


def test_llama_style_trains_and_refuses_what_it_cannot_build():
    model = build_model("gpt", (16,), 256, n_layers=2, d_model=32, n_heads=4, style="llama")
    x = torch.randint(0, 256, (2, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(UserError, match="style='bert' is not known; choose one of: gpt, llama"):
        build_model("gpt", (16,), 256, style="bert")
    with pytest.raises(UserError, match="rotary positions need an even head size"):
        build_model("gpt", (16,), 256, d_model=12, n_heads=4, style="llama")


@pytest.mark.parametrize(("name", "smallest"), [("googlenet", 32), ("inception_v3", 75)])
def test_inception_models_refuse_images_too_small_in_one_line(name, smallest):
    with pytest.raises(UserError, match=f"at least {smallest}x{smallest}"):
        build_model(name, (3, smallest - 1, smallest), 10)


def test_bert_large_has_its_published_shape_and_count():
    """BERT-large (24 layers, 1024 wide, 16 heads, 512 positions, 30,522 tokens) with its masked-LM head:
    the encoder and pooler's 335,141,888 less the pooler (1,049,600) plus the head's transform, norm and
    bias (1,082,170); the decoder is the token embedding itself."""
    with torch.device("meta"):
        model = build_model("bert", (512,), 30522, n_layers=24, d_model=1024, n_heads=16)
        y = model(torch.zeros(2, 512, dtype=torch.long))
    assert _n_params(model) == 335_141_888 - 1_049_600 + 1_082_170
    assert tuple(y.shape) == (2, 512, 30522)
    assert model[-1].embedding.weight is model[0].tok.weight


def test_the_bert_sees_the_whole_sequence():
    """An encoder: changing the last token changes the first position's logits (a gpt's would not)."""
    torch.manual_seed(0)
    model = build_model("bert", (8,), 20, n_layers=1, d_model=16, n_heads=2)
    x = torch.randint(0, 20, (1, 8))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 20
    assert not torch.allclose(model(x)[0, 0], model(y)[0, 0])


def test_the_bert_starts_from_berts_initialisation():
    torch.manual_seed(0)
    model = build_model("bert", (16,), 256, n_layers=2, d_model=64, n_heads=4)
    assert model[0].tok.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert all(float(m.bias.abs().max()) == 0 for m in model.modules() if isinstance(m, nn.Linear))
    loss = F.cross_entropy(model(torch.randint(0, 256, (4, 16))).flatten(0, 1), torch.randint(0, 256, (64,)))
    assert loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # uniform at start
