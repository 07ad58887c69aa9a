"""Generation as ``model.generate()`` runs it — TRL's rollouts, a decoder-only model's
generating evaluation — for a whole run's ``generate`` part, with the model's own forward and
its own key/value cache (transformers' ``DynamicCache``, which grows by a ``torch.cat`` per
layer and token: the old and the longer copy alive at once).

transformers' ``_sample`` loop, as memory sees it: the prompt runs through the model once
(``logits_to_keep=1``: the last position's logits only), then for each new token the last
position's logits are copied in fp32 (``.to(copy=True, dtype=torch.float32)``), divided by the
temperature (a new tensor, counted even where the temperature is 1), turned into
probabilities (softmax) and sampled (``torch.multinomial``); the token is appended to the ids
(``torch.cat``) and run through the model with the cache. The loop's own stopping test reads
values (``unfinished_sequences.max() == 0``), which a trace has none of: every prompt runs to
its ``new_tokens``, the longest generation. The sampling filters a job states (top-k, top-p,
min-p) are transformers' own warpers, applied as ``generate()`` orders them, after the
temperature: top-p's sort of every token's score (and its int64 indices), softmax and cumulative
sum are what they allocate.

An encoder-decoder model (T5, BART) generates as ``generate()`` runs it for one: the encoder
once over the prompts (its output, and the prompts, kept to the end), then the decoder from its
start token (``decoder_start_token_id``: one id per prompt), the tokens appended to the
decoder's ids; its cache is transformers' ``EncoderDecoderCache``, the decoder's self-attention
keys and values growing by a token per step beside the cross-attention's, made from the
encoder's output at the first step and kept.
"""

import contextlib
import inspect

import torch

from .device import DEVICE
from .models import ReferenceError_


def generate(model, prompt_shape, new_tokens, autocast, rec, filters=None):
    """``model.generate(prompts, max_new_tokens=new_tokens, do_sample=True, **filters)`` in eval
    mode under ``torch.no_grad()`` (and ``autocast``, where training runs under it): prompts of
    ``prompt_shape`` (batch, length) token ids made on the GPU, then ``new_tokens`` tokens.
    ``filters``: the job document's (``top_k``, ``top_p``, ``min_p``)."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" not in params or not hasattr(model, "generate"):
        raise ReferenceError_(
            f"generation (--generate-tokens) applies to Hugging Face generative models; {type(model).__name__} has no key/value cache"
        )
    # transformers 5.24 renamed `past_key_values` to `cache`; earlier releases take the old name.
    cache_name = "cache" if "cache" in params else "past_key_values"
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    warpers = _warpers(filters or {})
    model.eval()
    rec.kernels = False
    with torch.no_grad(), autocast if autocast is not None else contextlib.nullcontext():
        ids = torch.empty(prompt_shape, dtype=torch.long, device=DEVICE)
        rec.phase = "forward"
        prompts = encoded = None
        if getattr(model.config, "is_encoder_decoder", False):
            prompts = ids
            encoded = model.get_encoder()(input_ids=prompts, return_dict=True)
            ids = torch.empty((prompt_shape[0], 1), dtype=torch.long, device=DEVICE)
            # The decoder's turn: the encoder's output rides along with each token.
            step_input = lambda tokens, **kw: dict(  # noqa: E731
                encoder_outputs=encoded, decoder_input_ids=tokens, **kw
            )
        else:
            step_input = lambda tokens, **kw: dict(input_ids=tokens, **kw)  # noqa: E731
        out = model(**step_input(ids, use_cache=True, **keep))
        for step in range(new_tokens):
            logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            cache = getattr(out, cache_name, None) or out.past_key_values
            out = None  # `del outputs`: the model's logits and hidden states go
            # The temperature's processor (a temperature other than 1): a new tensor, kept
            # here whatever the temperature, for the bound.
            scores = logits / 1.0
            for warp in warpers:
                scores = warp(ids, scores)
            probs = torch.softmax(scores, dim=-1)
            tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
            logits = scores = probs = None
            ids = torch.cat([ids, tokens[:, None]], dim=-1)
            if step + 1 < new_tokens:
                out = model(
                    **step_input(tokens[:, None], use_cache=True, **{cache_name: cache}, **keep)
                )
            if autocast is not None:
                autocast.clear()
        out = cache = ids = tokens = step_input = prompts = encoded = None
    rec.kernels = True
    model.train()


def _warpers(filters):
    """transformers' own sampling warpers for ``filters``, in ``generate()``'s order (top-k,
    top-p, min-p); the values of p do not change what they allocate."""
    if not any(filters.values()):
        return []
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = []
    if filters.get("top_k"):
        warpers.append(TopKLogitsWarper(top_k=filters["top_k"]))
    if filters.get("top_p"):
        warpers.append(TopPLogitsWarper(top_p=0.9))
    if filters.get("min_p"):
        warpers.append(MinPLogitsWarper(min_p=0.05))
    return warpers
