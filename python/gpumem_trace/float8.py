"""Float8 training of a model's linear layers, as torchtitan's float8 converter applies it:
torchao's own ``convert_to_float8_training`` (run here, on meta tensors) swaps each
``nn.Linear`` whose dimensions are multiples of 16 for torchao's ``Float8Linear``, which casts
its input, weight and output gradient to float8 for each matmul (``torch._scaled_mm``); it keeps
the 16-bit input for backward and casts it again there. The output head stays in 16 bits, as
torchtitan's configs filter it (``filter_fqns = ["output"]``). ``recipe``: torchao's recipe name (tensorwise, rowwise,
rowwise_with_gw_hp); ``fsdp_all_gather``: tensorwise weights all-gathered by FSDP2 in float8,
their scales precomputed after each optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``)."""

import torch.nn as nn

from .models import ReferenceError_

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
HEADS = ("output", "lm_head")  # torchtitan's and Hugging Face's names of the output layer


def _torchao():
    try:
        import torchao.float8 as f8
    except ImportError as e:
        raise ReferenceError_(
            f"float8 training is torchao's code, which is not installed here (pip install torchao): {e}"
        ) from e
    return f8


def convert(model, spec):
    """Swaps ``model``'s linear layers for torchao's ``Float8Linear`` (``spec``: the job
    document's ``float8``); returns how many were swapped."""
    f8 = _torchao()
    recipe = spec.get("recipe", "tensorwise")
    if recipe not in RECIPES:
        raise ReferenceError_(f"float8 recipe `{recipe}` (expected {', '.join(RECIPES)})")
    if spec.get("fsdp_all_gather"):
        config = f8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = f8.Float8LinearConfig.from_recipe_name(recipe)
    swapped = []

    def convertible(module, fqn):
        ok = (
            isinstance(module, nn.Linear)
            and module.weight.shape[0] % 16 == 0
            and module.weight.shape[1] % 16 == 0
            and fqn.split(".")[-1] not in HEADS
        )
        if ok:
            swapped.append(fqn)
        return ok

    f8.convert_to_float8_training(model, config=config, module_filter_fn=convertible)
    if not swapped:
        raise ReferenceError_(
            "float8: the model has no linear layer whose dimensions are multiples of 16 (torchao's float8 matmuls need them)"
        )
    return len(swapped)


def subclasses():
    """torchao's float8 tensors: a cast (its float8 data and scale) and FSDP2's float8-gathered
    weight, each running its ops on its inner tensors."""
    _torchao()
    from torchao.float8.float8_training_tensor import Float8TrainingTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return (Float8TrainingTensor, WeightWithDynamicFloat8CastTensor)


def after_optimizer_step(model, spec):
    """torchtitan's post-optimizer hook: with float8 all-gathers, each weight's scale computed
    for the next step's gathers."""
    if spec.get("fsdp_all_gather"):
        _torchao().precompute_float8_dynamic_scale_for_fsdp(model)
