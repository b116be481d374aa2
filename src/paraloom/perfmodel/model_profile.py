"""What a model costs, layer by layer: the profile a plan is priced from (torch-free; measured by
`perfmodel.measure.profile.profile_model`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from paraloom.config.errors import UserError

OP_CLASSES = ("matmul", "conv", "attention", "other")  # how FLOPs and bytes are counted, by op class
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes per element of each profile dtype
RECOMPUTE = ("none", "selective", "full")
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}  # fp32 state tensors per parameter (Adam: m and v)
PROFILE_BATCHES = (2, 4)  # per-sample values are the slope between these: batch norm needs two samples,
# and batch-independent terms (parameter reads, batch-norm statistics) drop out of per-sample figures
KERNELS = ("fwd_kernels", "bwd_kernels", "fwd_ops", "bwd_ops")  # counts per step, not per sample


@dataclass(frozen=True)
class LayerProfile:
    """One top-level piece (a pipeline stage holds a contiguous run of them); figures are per sample."""

    name: str  # top-level child name ("0", "1", ...) or, for a model that is not a sequence, its class
    fwd_flops: dict[str, float]  # by op class: "matmul", "conv", "attention", "other"
    bwd_flops: dict[str, float]  # same classes; recomputation is not included here
    param_count: int  # a parameter shared between layers counts in the first only
    activation_bytes: float  # distinct storages this layer saves for backward (its input included if saved),
    # in the profile's dtype; ModelProfile.activation_bytes() counts a tensor two neighbours both save once
    output_bytes: float  # this layer's output: what a pipeline stage sends on
    fwd_mem_bytes: dict[str, float] = field(default_factory=dict)  # bytes read + written, by op class
    bwd_mem_bytes: dict[str, float] = field(default_factory=dict)
    input_saved_bytes: float = 0.0  # part of activation_bytes that is this layer's input
    output_saved_bytes: float = 0.0  # part of activation_bytes that is this layer's own output
    fwd_kernels: int = 0  # ops that do work in forward, whatever the batch (a kernel launch each on a GPU)
    bwd_kernels: int = 0
    param_tensors: int = 0  # parameter tensors (counted where param_count counts them)
    fwd_ops: dict[str, int] = field(default_factory=dict)  # fwd_kernels by op class
    bwd_ops: dict[str, int] = field(default_factory=dict)
    work_bytes: float = 0.0  # what its forward and backward hold at once beyond what it saves, at the peak
    held_bytes: float = 0.0  # what its forward leaves alive for backward: saved tensors, and the inputs a
    # checkpointed part (selective recomputation) keeps to recompute from (activation_bytes misses those)
    fwd_winograd: float = 0.0  # the part of fwd_flops["conv"] in 3x3 stride-1 convolutions
    bwd_winograd: float = 0.0
    fwd_winograd5: float = 0.0  # and in 5x5 stride-1 convolutions
    bwd_winograd5: float = 0.0


@dataclass(frozen=True)
class ModelProfile:
    """A model's layers plus what a plan needs: parameter, gradient, optimizer and activation bytes."""

    spec: str
    dtype: str  # "fp32", or "fp16"/"bf16": mixed precision as paraloom trains it, fp32 weights and autocast
    # (profiled under autocast's own casts: perfmodel/measure/autocast.py); see optimizer_bytes for the memory
    recompute: str  # "none" | "full" (every layer keeps only its input; backward recomputes it)
    layers: tuple[LayerProfile, ...]
    input_bytes: float  # per sample, as loaded (int64 tokens, fp32 images), or the activation a stage gets
    half_model: bool = False  # the model itself in dtype, no autocast (as Megatron-LM and DeepSpeed train)

    @property
    def n_params(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    @property
    def param_tensors(self) -> int:
        return sum(layer.param_tensors for layer in self.layers)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def param_bytes(self) -> float:
        return float(self.n_params * self.dtype_bytes)

    @property
    def grad_bytes(self) -> float:
        """Gradients are fp32 in every dtype: autocast's weights are fp32, and so are their gradients;
        a half-precision model's are in its dtype."""
        return float(self.n_params * (self.dtype_bytes if self.half_model else 4))

    @property
    def output_bytes(self) -> float:
        return self.layers[-1].output_bytes

    def optimizer_bytes(self, optimizer: str = "adam") -> float:
        """Optimizer state: fp32 moments (Adam m and v; momentum's one buffer; none for plain SGD).

        Mixed precision (fp16, bf16) adds the fp32 weights that autocast casts from, so that
        `param_bytes` is the low-precision copies autocast holds from forward to backward: with Adam
        2 + 4 (gradients) + (4 + 4 + 4) = 18 bytes per parameter, two more than the ZeRO paper's 16
        (Rajbhandari et al. 2020, section 3.1), whose fp16 gradients autocast's fp32 weights do not have.
        """
        if optimizer not in OPTIMIZER_STATES:
            raise UserError(f"optimizer {optimizer!r} is not known; choose one of: "
                            f"{', '.join(OPTIMIZER_STATES)}")
        master = 4 if self.dtype != "fp32" else 0
        return float(self.n_params * (master + 4 * OPTIMIZER_STATES[optimizer]))

    def flops_by_class(self, phase: str = "fwd") -> dict[str, float]:
        """Per-sample FLOPs by op class for "fwd", "bwd" or "recompute" (forward again if recompute=full)."""
        if phase not in ("fwd", "bwd", "recompute"):
            raise UserError(f"phase {phase!r} is not known; choose fwd, bwd or recompute")
        if phase == "recompute" and self.recompute != "full":  # selective's recomputation is in bwd
            return dict.fromkeys(OP_CLASSES, 0.0)
        attr = "bwd_flops" if phase == "bwd" else "fwd_flops"
        return {c: sum(getattr(layer, attr).get(c, 0.0) for layer in self.layers) for c in OP_CLASSES}

    def fwd_flops(self) -> float:
        return sum(self.flops_by_class("fwd").values())

    def bwd_flops(self) -> float:
        return sum(self.flops_by_class("bwd").values())

    def recompute_flops(self) -> float:
        return sum(self.flops_by_class("recompute").values())

    def activation_bytes(self, recompute: str | None = None) -> float:
        """Bytes saved for backward per sample; full recompute keeps every layer's input plus the saved
        tensors of the one layer being recomputed (the largest, as an upper bound)."""
        recompute = self.recompute if recompute is None else check_choice(recompute, RECOMPUTE, "recompute")
        if recompute == "selective":  # measured on the model built so: what each forward leaves behind,
            # and each layer's input where it saves it (the layer before's output: held counts neither)
            return sum(layer.held_bytes + layer.input_saved_bytes for layer in self.layers)
        if recompute == "full":
            inputs = self.input_bytes + sum(layer.output_bytes for layer in self.layers[:-1])
            return inputs + max(layer.activation_bytes - layer.input_saved_bytes for layer in self.layers)
        total = sum(layer.activation_bytes for layer in self.layers)
        for prev, layer in zip(self.layers, self.layers[1:], strict=False):  # saved on both sides: count once
            if prev.output_saved_bytes:
                total -= layer.input_saved_bytes
        return total

    def slice(self, start: int, stop: int) -> ModelProfile:
        """Layers [start, stop) as a profile of their own (a pipeline stage); its input is what it gets."""
        if not 0 <= start < stop <= len(self.layers):
            raise UserError(f"layers [{start}, {stop}) is not a non-empty range of the {len(self.layers)} "
                            f"layers of {self.spec!r}; choose 0 <= start < stop <= {len(self.layers)}")
        received = self.layers[start - 1].output_bytes if start else self.input_bytes
        return replace(self, layers=self.layers[start:stop], input_bytes=received)


def check_choice(value: str, choices: tuple[str, ...] | dict, what: str) -> str:
    if value not in choices:
        raise UserError(f"{what}={value!r} is not known; choose one of: {', '.join(choices)}")
    return value
