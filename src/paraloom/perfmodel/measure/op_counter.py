"""What a layer's ops cost, counted as they dispatch on the meta device: FLOPs and bytes read and
written by op class, kernels, the convolutions Winograd's algorithm takes, and the bytes alive at
once; and attention run as the fused kernel CUDA and CPU pick."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from paraloom.perfmodel.model_profile import OP_CLASSES

_ATEN = torch.ops.aten
_FREE = {_ATEN._unsafe_view, _ATEN.detach, _ATEN.alias, _ATEN.lift_fresh, _ATEN.empty_like,
         _ATEN.new_empty, _ATEN.new_empty_strided}  # no arithmetic, no memory traffic
_COPIES = {_ATEN._to_copy, _ATEN.clone, _ATEN.copy_, _ATEN.zeros_like, _ATEN.ones_like, _ATEN.full_like,
           _ATEN.fill_, _ATEN.zero_, _ATEN.new_zeros, _ATEN.new_ones, _ATEN.new_full}  # traffic, no FLOPs


def _op_class(packet: object) -> str:
    if packet not in flop_registry:
        return "other"
    name = str(packet)
    return "conv" if "conv" in name else "attention" if "attention" in name else "matmul"


def nbytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())  # expanded views read less


class OpCounter(TorchDispatchMode):
    """FLOPs and bytes read + written, by op class; matmul, conv and attention FLOPs use the formulas of
    `torch.utils.flop_counter` (as FlopCounterMode does); any other op counts one FLOP per element it
    writes, a rough figure for ops that are memory bound (their bytes matter more)."""

    def __init__(self, live: Live | None = None) -> None:
        super().__init__()
        self.flops = dict.fromkeys(OP_CLASSES, 0.0)
        self.mem = dict.fromkeys(OP_CLASSES, 0.0)
        self.kernels = 0  # ops that do work: on a GPU, a kernel launch each
        self.ops = dict.fromkeys(OP_CLASSES, 0)  # the same, by op class
        self.winograd = 0.0  # conv FLOPs of 3x3 stride-1 convolutions (device.winograd may divide them)
        self.winograd5 = 0.0  # and of 5x5 ones (the same Winograd tile, another factor: device_cost)
        self.live = live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if self.live is not None:
            self.live.add(outs)
        if func.is_view or packet in _FREE or not ins or not outs:
            return out
        cls = _op_class(packet)
        if cls != "other":
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            self.flops[cls] += flops
            size = _winograd_size(packet, args) if cls == "conv" else None
            if size == 3:
                self.winograd += flops
            elif size == 5:
                self.winograd5 += flops
        elif packet not in _COPIES:
            self.flops[cls] += sum(t.numel() for t in outs if t.is_floating_point())
        self.mem[cls] += sum(nbytes(t) for t in ins + outs)
        self.kernels += 1
        self.ops[cls] += 1
        return out


def _winograd_size(packet: object, args: tuple) -> int | None:
    """3 or 5 for a plain 3x3 or 5x5 stride-1 convolution (not transposed, not grouped): what
    Winograd's algorithm takes (cuDNN 5.1 onwards runs both, forward and backward); else None."""
    if packet is _ATEN.convolution:
        weight, stride, dilation, transposed, groups = args[1], args[3], args[5], args[6], args[8]
    elif packet is _ATEN.convolution_backward:
        weight, stride, dilation, transposed, groups = args[2], args[4], args[6], args[7], args[9]
    else:
        return None
    plain = all(s == 1 for s in stride) and all(d == 1 for d in dilation) and not transposed and groups == 1
    shape = tuple(weight.shape[2:])
    return shape[0] if plain and shape in ((3, 3), (5, 5)) else None


class Live:
    """The bytes of the storages made since it began that are still alive, and their peak: what a
    layer's forward and backward hold at once (storages are followed by weak reference)."""

    def __init__(self, shared: set[int]) -> None:
        self.shared, self.refs, self.peak = shared, {}, 0

    def add(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage._cdata not in self.shared and storage._cdata not in self.refs:
                self.refs[storage._cdata] = (storage._weak_ref(), storage.nbytes())
        total = 0
        for key, (ref, nbytes) in list(self.refs.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self.refs[key]
            else:
                total += nbytes
        self.peak = max(self.peak, total)

    def alive(self, leaving_out: set[int] = frozenset()) -> int:
        """Bytes of the followed storages still alive now, but those `leaving_out` names."""
        return sum(nbytes for key, (ref, nbytes) in self.refs.items()
                   if key not in leaving_out and not torch.UntypedStorage._expired(ref))

    def close(self) -> None:
        for ref, _ in self.refs.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self.refs.clear()


class FusedAttention(TorchFunctionMode):
    """Runs scaled_dot_product_attention as the fused flash kernel that CUDA and CPU pick (meta would take
    the math path, which saves the T x T scores); a mask or grouped heads keep the original call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            opts = dict(zip(names, rest, strict=False), **kwargs)
            if (opts.get("attn_mask") is None and not opts.get("enable_gqa") and q.dim() == 4
                    and q.shape == k.shape == v.shape):
                return _ATEN._scaled_dot_product_flash_attention(
                    q, k, v, opts.get("dropout_p", 0.0), opts.get("is_causal", False),
                    scale=opts.get("scale"))[0]
        return func(*args, **kwargs)


