"""LoRA fine-tuning as PEFT sets it up (``get_peft_model(model, LoraConfig(r, lora_alpha,
target_modules, lora_dropout))``), built here without PEFT: every parameter of the model is
frozen, and each target layer (``torch.nn.Linear`` or transformers' ``Conv1D``) becomes PEFT's
LoRA layer — the frozen layer plus two trainable factors, ``A`` (rank × in) and ``B`` (out ×
rank), with PEFT's forward:

    result = base(x)
    x = x.to(A.weight.dtype)                     # only where the dtypes differ
    result = (result + B(A(dropout(x))) * alpha / rank).to(base result's dtype)

Targets match as PEFT matches ``target_modules``: a module whose name is a target or ends with
``.target``; ``all-linear`` is every linear layer but the model's output embeddings.

QLoRA (``quant``): the model is loaded in 4 bits first, as transformers' ``BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4"|"fp4", bnb_4bit_use_double_quant=…)`` does —
every linear layer but the output embeddings becomes bitsandbytes' ``Linear4bit`` — and LoRA
then wraps its targets. With ``loader`` fabric, Lightning Fabric's ``BitsandbytesPrecision``
(litgpt's ``--quantize bnb.nf4``) does it instead: every linear layer, the output head too,
quantized from fp16. bitsandbytes need not be installed (``Linear4bit`` below holds what its
0.50 release holds, and what earlier releases the job names held).
"""

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch

from .models import ReferenceError_


@dataclass(frozen=True)
class Lora:
    rank: int
    alpha: float
    targets: tuple
    dropout: float = 0.0
    quant: str = None  # "nf4" or "fp4": QLoRA's 4-bit base weights
    double_quant: bool = True
    loader: str = "transformers"  # or "fabric": what quantizes the model as it loads
    # The bitsandbytes release, (major, minor, patch); None: the one restated here (0.50).
    bitsandbytes: tuple = None

    @classmethod
    def from_document(cls, doc):
        """A LoRA as the job vocabulary spells it (gpumem's request; checked where it was made)."""
        quant = doc.get("quant") or {}
        release = quant.get("bitsandbytes")
        return cls(
            rank=doc["rank"],
            alpha=doc["alpha"],
            targets=tuple(doc["targets"]),
            dropout=doc.get("dropout", 0.0),
            quant=None if not quant else ("nf4" if quant["nf4"] else "fp4"),
            double_quant=quant.get("double_quant", True),
            loader=quant.get("loader", "transformers"),
            bitsandbytes=None if release is None else tuple(int(p) for p in release.split(".")),
        )

    def keeps_matmul_input(self):
        """bitsandbytes before 0.43.2 kept each 4-bit layer's input for backward
        (``MatMul4Bit``'s ``ctx.tensors = (A, B)``), though only the weight's dequantization is
        used there; 0.43.2 dropped it (bitsandbytes#1270)."""
        return self.bitsandbytes is not None and self.bitsandbytes < (0, 43, 2)


class Linear4bit(torch.nn.Module):
    """bitsandbytes' ``Linear4bit`` (0.50) as memory sees it. The weight of ``n`` elements is
    packed two to a byte (``n/2`` uint8) with an absmax per 64-element block — fp32, or with
    double quantization a byte, plus an fp32 absmax per 256 of those, a 256-entry fp32 code and
    an fp32 offset — and the 16-entry fp32 code of nf4/fp4 (``quantize_4bit``'s QuantState).
    The statistics are kept as byte buffers of their size, so casting the model's floating-point
    tensors (pure bf16 training) leaves them as bitsandbytes keeps them. ``matmul_4bit``
    dequantizes the whole weight for the product, in forward and again in backward (the weight
    is frozen: only the input's gradient), into the dtype it was quantized from
    (``state_dtype``; None: the input's) and then casts it to the input's, and saves nothing
    else — but for the input itself, before 0.43.2 (``keeps_input``), held by the autograd node
    as long as its graph lives."""

    BLOCK, NESTED_BLOCK = 64, 256

    def __init__(self, base, double_quant, state_dtype=None, keeps_input=False):
        super().__init__()
        self.state_dtype, self.keeps_input = state_dtype, keeps_input
        w = base.weight
        self.in_features, self.out_features = (
            (w.shape[0], w.shape[1])
            if isinstance(base, _conv1d_types())
            else (w.shape[1], w.shape[0])
        )
        n, blocks = w.numel(), -(-w.numel() // self.BLOCK)
        byte = lambda k: torch.empty(k, dtype=torch.uint8, device=w.device)
        self.register_buffer("weight_packed", byte((n + 1) // 2))
        self.register_buffer("code", byte(16 * 4))
        if double_quant:
            self.register_buffer("absmax", byte(blocks))
            self.register_buffer("nested_absmax", byte(-(-blocks // self.NESTED_BLOCK) * 4))
            self.register_buffer("nested_code", byte(256 * 4))
            self.register_buffer("offset", byte(4))
        else:
            self.register_buffer("absmax", byte(blocks * 4))
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    @property
    def weight(self):
        """The packed bytes, as bitsandbytes' ``Params4bit`` weight is (code reads its device)."""
        return self.weight_packed

    # While a whole run loads the model: a function of a weight's shape that makes its copy on
    # the GPU before it is quantized (see loading_in_4bit); None otherwise.
    stage = None

    def _apply(self, fn, recurse=True):
        """Moving to the GPU while loading: transformers' bitsandbytes quantizer hands each weight
        to ``Params4bit``, which copies it to the GPU in its loaded dtype and quantizes it there
        (``quantize_4bit``: the packed weight and its statistics, this module's buffers) before
        the copy dies — one 16-bit weight at a time beside the quantized model."""
        if Linear4bit.stage is None:
            return super()._apply(fn, recurse)
        staged = Linear4bit.stage((self.out_features, self.in_features), self.state_dtype)
        out = super()._apply(fn, recurse)
        del staged
        return out

    def dequantize(self, dtype):
        """The weight, (out, in), in ``dtype``: ``dequantize_4bit(…).to(dtype)`` (a kernel
        writes every element of the first copy; the second exists only where dtypes differ)."""
        w = torch.zeros(
            (self.out_features, self.in_features),
            dtype=self.state_dtype or dtype,
            device=self.weight_packed.device,
        )
        return w.to(dtype)

    def forward(self, x):
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return _MatMul4bit.apply(x, self, bias)


class _MatMul4bit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer = layer
        if layer.keeps_input and ctx.needs_input_grad[0]:
            ctx.input = x  # an attribute, as bitsandbytes kept it: not freed by backward
        w = layer.dequantize(x.dtype)
        return torch.nn.functional.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.layer.dequantize(grad.dtype)
        return grad @ w, None, None


@contextlib.contextmanager
def loading_in_4bit(stage):
    """Within: moving a model to the GPU stages each ``Linear4bit`` weight first, as a 4-bit load
    does — ``stage(shape, dtype)`` makes that copy on the GPU, in ``dtype`` where the quantizer
    casts to one (``None``: buffers alone, as the training step's trace has them)."""
    saved, Linear4bit.stage = Linear4bit.stage, stage
    try:
        yield
    finally:
        Linear4bit.stage = saved


def quantize(model, lora: Lora, fabric=False):
    """Loads ``model`` in 4 bits: every linear layer but the output embeddings becomes a
    ``Linear4bit`` (transformers' default ``llm_int8_skip_modules``) — or every one, from fp16,
    as Lightning Fabric's ``BitsandbytesPrecision`` replaces ``torch.nn.Linear`` and quantizes
    ``weight.to(torch.half)`` (``lora.loader`` fabric, or ``fabric``: a trainer whose only
    quantizer is Fabric's)."""
    linear = (torch.nn.Linear,) + _conv1d_types()
    fabric = fabric or lora.loader == "fabric"
    output = None if fabric else _output_embeddings(model)
    chosen = [
        (n, m) for n, m in model.named_modules() if n and isinstance(m, linear) and m is not output
    ]
    for module_name, module in chosen:
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = Linear4bit(
            module,
            lora.double_quant,
            state_dtype=torch.float16 if fabric else None,
            keeps_input=lora.keeps_matmul_input(),
        )
        setattr(parent, child, layer)


def _conv1d_types():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return ()
    return (Conv1D,)


def is_adapter(module):
    """Whether ``module`` is a LoRA layer — this PEFT restatement's or litgpt's own
    (``litgpt.lora.LoRALayer``, where litgpt is loaded): one layer wrapped, not a block."""
    lit = sys.modules.get("litgpt.lora")
    return isinstance(module, LoraLayer) or (lit is not None and isinstance(module, lit.LoRALayer))


class LoraLayer(torch.nn.Module):
    def __init__(self, base, lora: Lora):
        super().__init__()
        self.base_layer = base
        if isinstance(base, Linear4bit):
            # The factors of a 4-bit layer are made as the model's floating-point tensors are
            # (then cast with them).
            in_f, out_f = base.in_features, base.out_features
            device, dtype = base.weight_packed.device, torch.get_default_dtype()
        else:
            w = base.weight
            # transformers' Conv1D keeps its weight as (in, out) (PEFT's fan_in_fan_out).
            in_f, out_f = (
                (w.shape[0], w.shape[1])
                if isinstance(base, _conv1d_types())
                else (w.shape[1], w.shape[0])
            )
            device, dtype = w.device, w.dtype
        self.lora_dropout = (
            torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
        )
        self.lora_A = torch.nn.Linear(in_f, lora.rank, bias=False, device=device, dtype=dtype)
        self.lora_B = torch.nn.Linear(lora.rank, out_f, bias=False, device=device, dtype=dtype)
        self.scaling = lora.alpha / lora.rank

    def forward(self, x, *args, **kwargs):
        result = self.base_layer(x, *args, **kwargs)
        result_dtype = result.dtype
        if x.dtype != self.lora_A.weight.dtype:
            x = x.to(self.lora_A.weight.dtype)
        result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        return result.to(result_dtype)


def factors(model):
    """The LoRA factors' parameters."""
    return [
        p
        for m in model.modules()
        if isinstance(m, LoraLayer)
        for f in (m.lora_A, m.lora_B)
        for p in f.parameters()
    ]


def cast_as_prepare_model_for_kbit_training(model, empty_cache):
    """PEFT's ``prepare_model_for_kbit_training`` after a 4-bit load: every fp16/bf16 parameter
    that is not 4-bit (embeddings, norms, the output head) cast to fp32 in place, one at a time
    (``param.data = param.data.to(torch.float32)``: the fp32 copy made, then the 16-bit one
    freed); then ``empty_cache()`` where the installed PEFT empties the allocator's cache after
    the casts (its ``auto_clear_cache``, in PEFT 0.21 and later)."""
    for p in model.parameters():
        if p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.to(torch.float32)
    try:
        from peft import prepare_model_for_kbit_training
    except ImportError:
        return
    if "auto_clear_cache" in inspect.signature(prepare_model_for_kbit_training).parameters:
        empty_cache()


def _output_embeddings(model):
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def apply(model, lora: Lora, name):
    """Freezes ``model`` (loaded in 4 bits for QLoRA) and puts a LoRA layer on each target;
    returns how many were wrapped."""
    if lora.quant:
        quantize(model, lora)
    linear = (torch.nn.Linear, Linear4bit) + _conv1d_types()
    every_linear = lora.targets == ("all-linear",)
    output = _output_embeddings(model) if every_linear else None

    def is_target(module_name, module):
        if every_linear:
            return isinstance(module, linear) and module is not output
        return any(module_name == t or module_name.endswith("." + t) for t in lora.targets)

    for p in model.parameters():
        p.requires_grad_(False)
    chosen = [(n, m) for n, m in model.named_modules() if n and is_target(n, m)]
    for module_name, module in chosen:
        if not isinstance(module, linear):
            raise ReferenceError_(
                f"{name}: LoRA target `{module_name}` is a {type(module).__name__}; gpumem models LoRA on Linear and Conv1D layers"
            )
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLayer(module, lora))
    if not chosen:
        raise ReferenceError_(
            f"{name}: no module matches the LoRA targets {', '.join(lora.targets)}"
        )
    return len(chosen)
