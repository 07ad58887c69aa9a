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
"""

from dataclasses import dataclass

import torch

from .models import ReferenceError_


@dataclass(frozen=True)
class Lora:
    rank: int
    alpha: float
    targets: tuple
    dropout: float = 0.0


def _conv1d_types():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return ()
    return (Conv1D,)


class LoraLayer(torch.nn.Module):
    def __init__(self, base, lora: Lora):
        super().__init__()
        self.base_layer = base
        w = base.weight
        # transformers' Conv1D keeps its weight as (in, out) (PEFT's fan_in_fan_out).
        in_f, out_f = (w.shape[0], w.shape[1]) if isinstance(base, _conv1d_types()) else (w.shape[1], w.shape[0])
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
        self.lora_A = torch.nn.Linear(in_f, lora.rank, bias=False, device=w.device, dtype=w.dtype)
        self.lora_B = torch.nn.Linear(lora.rank, out_f, bias=False, device=w.device, dtype=w.dtype)
        self.scaling = lora.alpha / lora.rank

    def forward(self, x, *args, **kwargs):
        result = self.base_layer(x, *args, **kwargs)
        result_dtype = result.dtype
        if x.dtype != self.lora_A.weight.dtype:
            x = x.to(self.lora_A.weight.dtype)
        result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        return result.to(result_dtype)


def _output_embeddings(model):
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def apply(model, lora: Lora, name):
    """Freezes ``model`` and puts a LoRA layer on each target; returns how many were wrapped."""
    linear = (torch.nn.Linear,) + _conv1d_types()
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
            raise ReferenceError_(f"{name}: LoRA target `{module_name}` is a {type(module).__name__}; gpumem models LoRA on Linear and Conv1D layers")
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLayer(module, lora))
    if not chosen:
        raise ReferenceError_(f"{name}: no module matches the LoRA targets {', '.join(lora.targets)}")
    return len(chosen)
