"""Model references: ``torchvision:NAME``, ``timm:NAME``, ``hf:CLASS(key=value,...)``,
``smp:ARCH(key=value,...)`` (segmentation_models_pytorch), ``torchtitan:MODEL(flavor=F,...)``
(torchtitan's own model builders), ``litgpt:NAME(key=value,...)`` (litgpt's own GPT) and
``py:path/to/file.py:function``.
Each resolves to a ``Job``: the model (built on the CPU with weight initialisation skipped), how
to make a batch of a given size, and the loss."""

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class ReferenceError_(Exception):
    """A bad model reference or option (exit code 2)."""


class Job:
    def __init__(
        self,
        model,
        batch_specs,
        loss,
        forward=None,
        seq_len=None,
        input_shape=None,
        keeps_outputs=True,
        specs_at=None,
        trainer_outputs_fp32=False,
        inputs=None,
        own_lora=None,
        compile_loss=None,
    ):
        self.model = model
        # (torch_compile) -> None: the job's loss switched to the trainer's compiled one
        # (``--compile``; ``torch_compile``: compiled.torch_compile), for a job whose trainer
        # compiles a loss of its own (torchtitan's, torchtune's).
        self.compile_loss = compile_loss
        # (lora.Lora, quantize) -> the model fine-tuned with LoRA as its trainer builds it, for a
        # source whose trainer has its own LoRA (litgpt's); None: PEFT's, on the model as it is.
        self.own_lora = own_lora
        # Names of parameters that train (a gradient each backward) but that the trainer's
        # optimizer does not hold, so that nothing ever frees their gradients.
        self.unoptimized = frozenset()
        # Whether the usual loop for this kind of model holds its output through backward.
        self.keeps_outputs = keeps_outputs
        # Whether that loop is Hugging Face's Trainer, whose model forward accelerate wraps:
        # under 16-bit mixed precision every 16-bit output comes back converted to fp32.
        self.trainer_outputs_fp32 = trainer_outputs_fp32
        self.batch_specs = batch_specs  # batch size -> list of (shape, dtype) of the batch tensors
        # (batch size, sequence length) -> the same at another length: a model that reads token
        # ids, whose batches are padded to a length that varies by step (None for the others).
        self.specs_at = specs_at
        self.loss = loss  # (output, batch tensors) -> scalar
        self.forward = forward or (lambda m, b: m(b[0]))
        # batch tensors -> the model's keyword inputs, for a model whose trainer calls it as
        # `model(**inputs)` (Hugging Face's): what that trainer's data collator would hand it.
        self.inputs = inputs
        self.seq_len = seq_len
        self.input_shape = input_shape

    def returns_fp32_outputs(self, keep_outputs, precision):
        """Whether the loop's outputs come back in fp32: the Trainer's loop (one that holds its
        outputs is not the Trainer's) in 16 bits."""
        return self.trainer_outputs_fp32 and not keep_outputs and precision != "fp32"


def outputs_in_fp32(outputs):
    """What Hugging Face's Trainer gets from its model's forward when it trains in 16 bits
    (``bf16``/``fp16``): accelerate wraps the forward in ``convert_outputs_to_fp32``, whose
    ``convert_to_fp32`` returns the output with each fp16/bf16 tensor cast to fp32 — for a
    language model, fp32 logits, which the evaluation loop then keeps. accelerate's own function
    where it is installed."""
    try:
        from accelerate.utils import convert_to_fp32
    except ImportError:

        def convert_to_fp32(out):
            half = (torch.float16, torch.bfloat16)
            for k, v in list(out.items()):
                if isinstance(v, torch.Tensor) and v.dtype in half:
                    out[k] = v.float()
            return out

    return convert_to_fp32(outputs)


@contextlib.contextmanager
def no_init():
    """Skips weight initialisation while a model is built: shapes are all the tracer needs."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda t, *a, **k: t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def build(make):
    """``make()`` run to build a model where it costs nothing: on the meta device, so a 70B
    model builds in seconds without its weights in memory; or, where construction reads tensor
    values (a timm model's schedule computed with ``.tolist()``), on the CPU with weight
    initialisation skipped. Either way the tracer then moves the model to its meta "GPU"."""
    try:
        with torch.device("meta"), no_init():
            return make()
    except Exception:
        with no_init():
            return make()


def _items(text):
    """``text`` split at the commas and semicolons outside brackets and quotes, so a value may
    be JSON (``rope_scaling={"factor":8.0,"rope_type":"llama3"}``, ``eos_token_id=[1,2]``)."""
    items, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            if c == quote and text[i - 1] != "\\":
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
        elif c in ",;" and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _value(v):
    """A value as JSON where it is JSON (numbers, ``true``, ``null``, quoted strings, lists,
    objects: what gpumem writes from a Hub config.json), else a bare word as typed by hand
    (``hidden_act=silu``, ``True``)."""
    try:
        return json.loads(v)
    except ValueError:
        pass
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(v, v)


def _kwargs(text, ref):
    out = {}
    for item in _items(text):
        if "=" not in item:
            raise ReferenceError_(f"{ref}: `{item}` is not key=value")
        k, v = (s.strip() for s in item.split("=", 1))
        out[k] = _value(v)
    return out


def _split_call(spec, ref):
    m = re.fullmatch(r"([^()]+)(?:\((.*)\))?", spec.strip())
    if not m:
        raise ReferenceError_(f"{ref}: cannot parse `{spec}`")
    return m.group(1).strip(), _kwargs(m.group(2) or "", ref)


def _require(module, hint):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ReferenceError_(
            f"cannot import {module}: {e} (install it: pip install {hint})"
        ) from e


def _trainer_modules(ref, release, *modules):
    """A trainer's own modules, for its models (``release``: the one gpumem runs, ``NAME==X``);
    a one-line refusal saying how to install it where they do not import."""
    trainer = release.split("==")[0]
    try:
        return [importlib.import_module(m) for m in modules]
    except ImportError as e:
        raise ReferenceError_(
            f"{ref}: {trainer} models need {trainer} installed in this Python ({e}); "
            f"install it: pip install {release}"
        ) from e


def _unknown(kind, name, known, also=""):
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ReferenceError_(f"unknown {kind} model `{name}`{hint}{also}")


def _classification(model, shape, classes, batch_first_key="logits"):
    def loss(out, batch):
        if isinstance(out, (tuple, list)):
            out = out[0]
        elif hasattr(out, batch_first_key):
            out = getattr(out, batch_first_key)
        return F.cross_entropy(out, batch[1])

    return Job(
        model, lambda b: [((b, *shape), torch.float32), ((b,), torch.long)], loss, input_shape=shape
    )


def _segmentation(model, shape):
    """Per-pixel class targets and the loss of torchvision's segmentation references:
    cross-entropy on ``out``, plus half of it on ``aux`` where the model has that head."""

    def loss(out, batch):
        if not isinstance(out, dict):
            return F.cross_entropy(out, batch[1])
        total = F.cross_entropy(out["out"], batch[1])
        if out.get("aux") is not None:
            total = total + 0.5 * F.cross_entropy(out["aux"], batch[1])
        return total

    return Job(
        model,
        lambda b: [((b, *shape), torch.float32), ((b, *shape[1:]), torch.long)],
        loss,
        input_shape=shape,
    )


def _torchvision_input(tv, name, family):
    """The input the model's own pretrained transforms make (read from its weights' metadata,
    nothing is downloaded): crop size for classification and video (16 frames), resize size
    for segmentation."""
    try:
        t = tv.models.get_model_weights(name).DEFAULT.transforms()
    except Exception:  # a builder without published weights
        t = None
    size = (
        getattr(t, "resize_size", None)
        if family == "segmentation"
        else getattr(t, "crop_size", None)
    )
    side = (size or [520 if family == "segmentation" else 224])[0]
    return (3, 16, side, side) if family == "video" else (3, side, side)


def torchvision_job(spec, ref, input_shape):
    tv = _require("torchvision", "torchvision")
    name, kw = _split_call(spec, ref)
    known = tv.models.list_models()
    if name not in known:
        _unknown("torchvision", name, known)
    family = next(
        (
            m
            for m in ("segmentation", "video", "detection", "optical_flow")
            if name in tv.models.list_models(module=getattr(tv.models, m))
        ),
        "classification",
    )
    if family in ("detection", "optical_flow"):
        raise ReferenceError_(
            f"{ref}: torchvision {family.replace('_', '-')} models train on per-image targets the tracer does not make yet (classification, segmentation and video models work)"
        )
    if name == "inception_v3":
        kw.setdefault("init_weights", False)
    if "weights_backbone" in inspect.signature(tv.models.get_model_builder(name)).parameters:
        kw.setdefault("weights_backbone", None)  # no download of pretrained backbone weights
    model = build(lambda: tv.models.get_model(name, weights=None, **kw))
    shape = input_shape or _torchvision_input(tv, name, family)
    if family == "segmentation":
        return _segmentation(model, shape)
    return _classification(model, shape, kw.get("num_classes", 1000))


def timm_job(spec, ref, input_shape):
    timm = _require("timm", "timm")
    name, kw = _split_call(spec, ref)
    if not timm.is_model(name):
        _unknown("timm", name, timm.list_models())
    model = build(lambda: timm.create_model(name, pretrained=False, **kw))
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", {}) or {}
    shape = input_shape or tuple(cfg.get("input_size", (3, 224, 224)))
    return _classification(model, shape, getattr(model, "num_classes", 1000) or 1000)


def smp_job(spec, ref, input_shape):
    """``smp:ARCH(key=value,...)``: segmentation_models_pytorch's ``create_model(ARCH, **keys)``
    with no encoder weights. ``loss=ce`` (default) or ``loss=dice`` (smp's DiceLoss); one class
    trains a binary mask with BCE, more a class map. Input 3×512×512 unless given."""
    smp = _require("segmentation_models_pytorch", "segmentation-models-pytorch")
    arch, kw = _split_call(spec, ref)
    known = (
        sorted(smp.MODEL_ARCHITECTURES_MAPPING)
        if hasattr(smp, "MODEL_ARCHITECTURES_MAPPING")
        else []
    )
    match = {k.lower(): k for k in known}.get(arch.lower())
    if match is None:
        _unknown("segmentation_models_pytorch", arch, known)
    loss_name = str(kw.pop("loss", "ce")).lower()
    if loss_name not in ("ce", "dice"):
        raise ReferenceError_(f"{ref}: loss `{loss_name}` is not ce or dice")
    kw.setdefault("encoder_weights", None)
    model = build(lambda: smp.create_model(match, **kw))
    classes = int(kw.get("classes", 1))
    shape = input_shape or (kw.get("in_channels", 3), 512, 512)
    if classes == 1:
        dice = smp.losses.DiceLoss(mode="binary") if loss_name == "dice" else None
        target = lambda b: ((b, 1, *shape[1:]), torch.float32)
        loss = (
            (lambda out, batch: dice(out, batch[1]))
            if dice
            else (lambda out, batch: F.binary_cross_entropy_with_logits(out, batch[1]))
        )
    else:
        dice = smp.losses.DiceLoss(mode="multiclass") if loss_name == "dice" else None
        target = lambda b: ((b, *shape[1:]), torch.long)
        loss = (
            (lambda out, batch: dice(out, batch[1]))
            if dice
            else (lambda out, batch: F.cross_entropy(out, batch[1]))
        )
    return Job(model, lambda b: [((b, *shape), torch.float32), target(b)], loss, input_shape=shape)


# Hub names the seed used, as config keys (no Hub access).
HF_NAMED = {
    "xlnet-base-cased": {"d_model": 768, "n_layer": 12, "n_head": 12, "d_inner": 3072},
    "xlnet-large-cased": {"d_model": 1024, "n_layer": 24, "n_head": 16, "d_inner": 4096},
    "bert-base-uncased": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
    "bert-large-uncased": {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
    },
    "gpt2": {"n_embd": 768, "n_layer": 12, "n_head": 12},
    "gpt2-medium": {"n_embd": 1024, "n_layer": 24, "n_head": 16},
    "gpt2-large": {"n_embd": 1280, "n_layer": 36, "n_head": 20},
    "gpt2-xl": {"n_embd": 1600, "n_layer": 48, "n_head": 25},
}
# Short keys of the seed's data files.
HF_ALIASES = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
}


# Keys of an hf: reference that are not config fields but config arguments.
HF_CONFIG_ARGUMENTS = {"attn_implementation"}


def _padded_batches(tr):
    """The batch is padded: Hugging Face's checks whether an attention mask can be dropped
    (every token attended, so SDPA's `is_causal` or no mask will do) must answer no. Those checks
    read the mask's values, which meta tensors do not have."""
    try:
        import transformers.masking_utils as mu  # transformers 4.53+

        mu.fast_all = lambda t: torch.zeros((), dtype=torch.bool, device=t.device)
    except ImportError:
        pass
    try:
        from transformers.modeling_attn_mask_utils import AttentionMaskConverter  # older releases

        AttentionMaskConverter._ignore_causal_mask_sdpa = staticmethod(lambda *a, **k: False)
    except ImportError:
        pass


# The config's `attn_implementation` of each --attention: FlashAttention-2 is traced as SDPA's
# flash kernel (forced in loop.attention_stack), which keeps the same tensors for backward.
HF_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash": "sdpa"}
# transformers' names for FlashAttention (the CUDA-only flash-attn package).
HF_FLASH = ("flash_attention_2", "flash_attention_3")


def hf_job(spec, ref, seq_len, attention_mask="none", attention=None):
    """``hf:CLASS(key=value,...)``: a transformers class built from its config with these keys
    (no Hub access), trained the way its head trains, on the input it reads
    (``main_input_name``: token ids of ``seq_len``, images at the config's size, raw audio of
    ``seq_len`` samples, log-mel frames): language models (causal, masked, sequence-to-sequence)
    with token ``labels``, sequence/image/audio classifiers with one label per sample,
    contrastive models (CLIP, SigLIP) on text and images with ``return_loss``.
    ``attention_mask="padded"`` passes a mask of a padded batch, which the model materialises —
    but not under FlashAttention-2, which unpads the batch instead (every token taken as real,
    the most it can hold). ``attention`` sets the config's ``attn_implementation``."""
    tr = _require("transformers", "transformers")
    m = re.fullmatch(r"([^()]+)(?:\((.*)\))?", spec.strip())
    if not m:
        raise ReferenceError_(f"{ref}: cannot parse `{spec}`")
    name, inner = m.group(1).strip(), (m.group(2) or "").strip()
    if inner and "=" not in inner:
        if inner not in HF_NAMED:
            raise ReferenceError_(
                f"{ref}: `{inner}` is a Hub name gpumem does not know offline; give config keys instead"
            )
        kw = dict(HF_NAMED[inner])
    else:
        kw = _kwargs(inner, ref)
    try:
        cls = getattr(tr, name, None)
    except ImportError as e:  # transformers refuses this torch (it needs a newer one)
        raise ReferenceError_(
            f"{ref}: transformers {tr.__version__} cannot use torch {torch.__version__} ({str(e).strip() or 'its models need a newer torch'}); "
            "install a transformers release that supports this torch"
        ) from e
    if cls is None or not isinstance(cls, type) or not hasattr(cls, "config_class"):
        known = [n for n in dir(tr) if n[:1].isupper() and ("For" in n or n.endswith("Model"))]
        also = " (a model only in a checkpoint's own code runs as hf-code:ORG/NAME)"
        _unknown("Hugging Face", name, known, also)
    # A warning that reads token values (pad tokens present without a mask?): on meta tensors
    # every such question answers yes, and for some configs the warning itself then fails.
    if hasattr(tr, "PreTrainedModel"):
        tr.PreTrainedModel.warn_if_padding_and_no_attention_mask = lambda *a, **k: None
    if attention:
        stated = kw.get("attn_implementation")
        names = {attention, HF_ATTENTION[attention], *(HF_FLASH if attention == "flash" else ())}
        if stated is not None and stated not in names:
            raise ReferenceError_(
                f"{ref}: attn_implementation={stated} and --attention {attention} disagree; give one"
            )
        kw["attn_implementation"] = HF_ATTENTION[attention]
        if attention == "flash":
            attention_mask = "none"
    elif kw.get("attn_implementation") in HF_FLASH:
        # The flash-attn package is CUDA's; gpumem runs it as SDPA's flash kernel (the job's).
        raise ReferenceError_(
            f"{ref}: attn_implementation={kw['attn_implementation']}: give --attention flash "
            "(gpumem traces FlashAttention-2 as SDPA's flash kernel)"
        )
    config_cls = cls.config_class
    fields = set(config_cls().to_dict())
    mapped = {}
    for k, v in kw.items():
        k2 = k if k in fields else HF_ALIASES.get(k, k)
        close = difflib.get_close_matches(k2, fields, n=1, cutoff=0.85)
        if k2 not in fields and k2 not in HF_CONFIG_ARGUMENTS and close:
            raise ReferenceError_(
                f"{ref}: {config_cls.__name__} has no field `{k}`; did you mean `{close[0]}`?"
            )
        # Other keys are taken as a Hub config.json states them and as transformers' own loading
        # takes them: renamed ones (rope_theta, rope_scaling) are read by the config's
        # constructor, stale ones kept as attributes the model does not read.
        mapped[k2] = v
    config = config_cls(**mapped)
    _hf_config_defaults(config, name)
    return hf_model_job(tr, name, ref, config, build(lambda: cls(config)), seq_len, attention_mask)


# The auto classes a checkpoint's own code may name its model under, the training heads first,
# each with the class-name ending hf_model_job reads a head from (the code's own class name,
# `QWenLMHeadModel`, need not say it).
HF_CODE_HEADS = {
    "AutoModelForCausalLM": "ForCausalLM",
    "AutoModelForSeq2SeqLM": "ForConditionalGeneration",
    "AutoModelForSequenceClassification": "ForSequenceClassification",
    "AutoModelForMaskedLM": "ForMaskedLM",
    "AutoModel": None,
}


def hf_code_job(spec, ref, seq_len, attention_mask="none"):
    """``hf-code:DIR``: a checkpoint run by its own code (transformers' ``trust_remote_code``):
    its config class and model class loaded from the modeling files in DIR that its
    ``auto_map`` names (offline: DIR is a model directory or a Hub cache snapshot), the model
    built from the config on no weights, and trained as ``hf_job`` trains the head its auto
    class names (a causal language model on token ids with ``labels``)."""
    tr = _require("transformers", "transformers")
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise ReferenceError_(f"{ref}: {spec} is no model directory with a config.json")
    try:
        config = tr.AutoConfig.from_pretrained(spec, trust_remote_code=True, local_files_only=True)
        auto = getattr(config, "auto_map", None) or {}
        head = next((h for h in HF_CODE_HEADS if h in auto), None)
        if head is None:
            raise ReferenceError_(
                f"{ref}: its auto_map names no model class ({', '.join(auto) or 'nothing'})"
            )
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        target = auto[head]
        cls = get_class_from_dynamic_module(
            target[0] if isinstance(target, (list, tuple)) else target, spec, local_files_only=True
        )
    except ReferenceError_:
        raise
    except Exception as e:  # noqa: BLE001 - the checkpoint's own code, whatever it raises
        raise ReferenceError_(
            f"{ref}: its own code could not be loaded with transformers {tr.__version__} "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e})"
        ) from e
    name = HF_CODE_HEADS[head] or cls.__name__
    _hf_config_defaults(config, name)
    return hf_model_job(tr, name, ref, config, build(lambda: cls(config)), seq_len, attention_mask)


def _hf_config_defaults(config, name):
    """What a batch of several sequences needs of a config, as pretrained configs set it."""
    lower = name.lower()
    text = getattr(config, "text_config", None) or config
    for c in (config,) if text is config else (config, text):
        if (
            "sequenceclassification" in lower or getattr(c, "is_encoder_decoder", False)
        ) and getattr(c, "pad_token_id", None) is None:
            c.pad_token_id = (
                0  # batches of more than one sequence need one (a nested text config too)
            )
    if (
        getattr(config, "is_encoder_decoder", False)
        and getattr(config, "decoder_start_token_id", None) is None
    ):
        config.decoder_start_token_id = (
            config.pad_token_id
        )  # labels are shifted right behind it, as pretrained configs set


def hf_model_job(tr, name, ref, config, model, seq_len, attention_mask):
    """The job of a built transformers model of class ``name``: trained the way its head trains,
    on the input it reads (see ``hf_job``)."""
    lower = name.lower()
    text = getattr(config, "text_config", None) or config
    if (
        hasattr(model, "set_default_language")
        and getattr(config, "default_language", None) is None
        and getattr(config, "languages", None)
    ):
        model.set_default_language(config.languages[0])  # X-MOD's adapters need one
    limits = [getattr(text, k, None) for k in ("max_position_embeddings", "n_positions")]
    seq = seq_len or min([512] + [n for n in limits if isinstance(n, int) and n > 0])
    if attention_mask == "padded":
        _padded_batches(tr)

    def at_length(seq):
        """The batch specs, forward, and length of token ids at sequence length ``seq``."""
        vision = getattr(config, "vision_config", None) or config
        side = getattr(vision, "image_size", 224)
        side = side[0] if isinstance(side, (list, tuple)) else side
        image = (getattr(vision, "num_channels", 3), side, side)
        ids = lambda b: ((b, seq), torch.long)
        # What the model reads (`main_input_name`): token ids, images, raw audio, or spectrograms.
        main = getattr(model, "main_input_name", "input_ids")
        if main == "pixel_values":
            x, seq = (lambda b: ((b, *image), torch.float32)), None
        elif main == "input_values":  # raw audio: --seq-len samples, default one second at 16 kHz
            samples = seq_len or 16000
            x, seq = (lambda b: ((b, samples), torch.float32)), None
        elif main == "input_features":  # log-mel frames, as many as the encoder takes
            frames = seq_len or 2 * getattr(config, "max_source_positions", 1500)
            stacked = getattr(
                config, "feature_projection_input_dim", None
            )  # Wav2Vec2-BERT: frames first
            shape = (frames, stacked) if stacked else (getattr(config, "num_mel_bins", 80), frames)
            x, seq = (lambda b: ((b, *shape), torch.float32)), None
        else:
            x = ids
        one_label = any(
            k in lower
            for k in ("sequenceclassification", "imageclassification", "audioclassification")
        )
        label = (lambda b: ((b,), torch.long)) if one_label else ids
        codebooks = getattr(config, "num_codebooks", None)
        if name.startswith("Musicgen") and isinstance(codebooks, int) and codebooks > 1:
            # MusicGen's decoders read every codebook's stream, ids as (batch × codebooks, seq).
            x = lambda b: ((b * codebooks, seq), torch.long)
            label = lambda b: ((b, seq, codebooks), torch.long)
        if (
            hasattr(model, "get_image_features")
            and hasattr(model, "get_text_features")
            and "for" not in lower
        ):
            specs = lambda b: [ids(b), ((b, *image), torch.float32)]
            inputs = lambda b: dict(
                input_ids=b[0], pixel_values=b[1], return_loss=True, **_mask(b, 2)
            )
        elif (
            lower.endswith(("forcausallm", "formaskedlm"))
            and "pixel_values" in inspect.signature(model.forward).parameters
            and (hasattr(config, "vision_config") or hasattr(config, "image_size"))
        ):
            # A text head over an image too (GIT's captions, ViLT's masked words): both inputs.
            specs = lambda b: [ids(b), label(b), ((b, *image), torch.float32)]
            inputs = lambda b: dict(input_ids=b[0], labels=b[1], pixel_values=b[2], **_mask(b, 3))
        else:
            specs = lambda b: [x(b), label(b)]
            inputs = lambda b: {main: b[0], "labels": b[1], **_mask(b, 2)}
        if attention_mask == "padded":
            if seq is None:
                raise ReferenceError_(
                    f"{ref}: --attention-mask applies to models that read token ids"
                )
            base = specs
            specs = lambda b: base(b) + [ids(b)]
        return specs, inputs, seq, image, main

    specs, inputs, seq, image, main = at_length(seq)
    if seq is None:
        specs_at = None  # the model reads no token ids: its input has no sequence length
    else:
        specs_at = lambda b, length: at_length(length)[0](b)
    # Hugging Face's Trainer takes `loss = model(**batch).loss`: the output is not held.
    return Job(
        model,
        specs,
        lambda out, batch: out.loss,
        forward=lambda m, b: m(**inputs(b)),
        inputs=inputs,
        seq_len=seq,
        input_shape=image if main == "pixel_values" else None,
        keeps_outputs=False,
        specs_at=specs_at,
        trainer_outputs_fp32=True,
    )


def torchtitan_job(spec, ref, seq_len, gpu_capability):
    """``torchtitan:MODEL(flavor=FLAVOR,key=value,...)``: torchtitan's own model as its Trainer
    builds it — its train spec's model class from the flavor's model args (other keys override
    those args; a dotted key, ``moe_args.top_k=2``, a nested config's), ``update_from_config`` with the job's sequence length — trained as its
    ``forward_backward_step`` runs (torchtitan 0.2.x): ``pred = model(tokens)``, its own loss
    (``build_loss_fn``: cross-entropy on the logits cast to fp32, summed) divided by the
    count of valid tokens, ``del pred``, backward. Needs torchtitan installed.
    ``gpu_capability``: the GPU the job runs on, which ``update_from_config`` asks (its MoE
    experts' grouped GEMMs need SM90; below, a loop over the experts)."""
    train_spec, job_config_mod = _trainer_modules(
        ref,
        "torchtitan==0.2.2",
        "torchtitan.protocols.train_spec",
        "torchtitan.config.job_config",
    )
    import copy
    import dataclasses

    name, kw = _split_call(spec, ref)
    try:
        ts = train_spec.get_train_spec(name)
    except ValueError:
        known = importlib.import_module("torchtitan.models")._supported_models
        _unknown("torchtitan", name, sorted(known))
    flavor = kw.pop("flavor", None)
    if flavor is None:
        raise ReferenceError_(
            f"{ref}: say which flavor, e.g. torchtitan:{name}(flavor={next(iter(ts.model_args))}) "
            f"(flavors: {', '.join(map(str, ts.model_args))})"
        )
    flavor = str(flavor)
    if flavor not in ts.model_args:
        raise ReferenceError_(
            f"{ref}: torchtitan {name} has no flavor `{flavor}` (flavors: {', '.join(map(str, ts.model_args))})"
        )
    args = copy.deepcopy(ts.model_args[flavor])
    for k, v in kw.items():
        # A dotted key sets a field of a nested config (moe_args.num_experts=8).
        *path, field = k.split(".")
        owner = args
        for part in path:
            owner = getattr(owner, part, None)
        fields = (
            {f.name for f in dataclasses.fields(owner)}
            if dataclasses.is_dataclass(owner)
            else set()
        )
        if field not in fields:
            raise ReferenceError_(
                f"{ref}: `{k}` is not a field of torchtitan's {type(owner).__name__} (fields: {', '.join(sorted(fields))})"
            )
        setattr(owner, field, v)
    config = job_config_mod.JobConfig()
    seq_len = seq_len or 2048
    config.training.seq_len = seq_len
    config.model.name, config.model.flavor = name, flavor
    args_module = sys.modules[type(args).__module__]
    asked = getattr(args_module, "has_cuda_capability", None)
    target = tuple(int(x) for x in str(gpu_capability).split("."))
    if asked is not None:
        args_module.has_cuda_capability = lambda major, minor: target >= (major, minor)
    try:
        args.update_from_config(config)
    finally:
        if asked is not None:
            args_module.has_cuda_capability = asked
    moe = getattr(args, "moe_args", None)
    if moe is not None and getattr(args, "moe_enabled", True) and not moe.use_grouped_mm:
        raise ReferenceError_(
            f"{ref}: below SM90 (this GPU: {gpu_capability}) torchtitan runs its MoE experts in a loop sized by the router's values, which gpumem does not trace; size it for an SM90 GPU"
        )
    model = build(lambda: ts.model_cls(args))
    loss_fn = ts.build_loss_fn(config)
    built = [loss_fn]

    def compile_loss(torch_compile):
        # torchtitan's own choice: `compile.components` naming the loss compiles it.
        config.compile.enable, config.compile.components = True, ["loss"]
        with torch_compile():
            built[0] = ts.build_loss_fn(config)

    ignore = getattr(importlib.import_module("torchtitan.components.loss"), "IGNORE_INDEX", -100)
    vocab = getattr(args, "vocab_size", None)
    if vocab is None:
        raise ReferenceError_(f"{ref}: gpumem trains torchtitan's language models (no vocab_size)")

    def specs(b):
        return [((b, seq_len), torch.long), ((b, seq_len), torch.long)]

    def loss(pred, batch):
        # The trainer divides the summed loss by the batch's valid tokens (all-reduced).
        valid = (batch[1] != ignore).sum()
        return built[0](pred, batch[1]) / valid

    return Job(model, specs, loss, seq_len=seq_len, keeps_outputs=False, compile_loss=compile_loss)


# litgpt's LoRA switches (its Config's lora_* fields), and the Hugging Face module names a LoRA
# target may be given by instead.
LITGPT_LORA = ("query", "key", "value", "projection", "mlp", "head")
LITGPT_HF_TARGETS = {
    "q_proj": "query",
    "k_proj": "key",
    "v_proj": "value",
    "o_proj": "projection",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "lm_head": "head",
}


def litgpt_job(spec, ref, seq_len):
    """``litgpt:NAME(key=value,...)``: litgpt's own GPT (``litgpt.Config.from_name(NAME,
    **keys)``; NAME a litgpt config name or the Hub id it stands for), trained as its fine-tuning
    scripts (``litgpt finetune``/``finetune_lora``, 0.5.x) run a step: ``model.max_seq_length``
    set to the job's length; ``logits = model(input_ids, lm_head_chunk_size=128)`` — the head's
    output as a list of 128-position chunks, the last one shifted; ``chunked_cross_entropy``
    over them; backward; the logits held until the next forward. ``lm_head_chunk_size=0`` (a
    key of the reference, not of litgpt's Config) is ``litgpt pretrain``'s step: the whole
    logits, cross-entropy over chunks of 128 rows. With LoRA, litgpt's own LoRA model
    (``litgpt.lora.GPT``, see ``own_lora``). Needs litgpt installed."""
    config_mod, model_mod, utils = _trainer_modules(
        ref, "litgpt==0.5.13", "litgpt.config", "litgpt.model", "litgpt.utils"
    )
    name, kw = _split_call(spec, ref)
    chunk = int(kw.pop("lm_head_chunk_size", 128))

    def config(cls, **lora):
        try:
            return cls.from_name(name, **kw, **lora)
        except ValueError:
            _unknown("litgpt", name, sorted(config_mod.name_to_config))
        except TypeError as e:
            raise ReferenceError_(f"{ref}: litgpt's Config: {e}") from e

    base = config(config_mod.Config)
    seq = seq_len or base.block_size
    if seq > base.block_size:
        raise ReferenceError_(
            f"{ref}: a sequence of {seq} tokens is longer than litgpt's block_size {base.block_size} for {name}"
        )

    def make(cls, cfg):
        model = build(lambda: cls(cfg))
        # fit() sets it to the longest sample: the rope cache is built for that length.
        model.max_seq_length = seq
        return model

    def specs(b):
        return [((b, seq), torch.long), ((b, seq), torch.long)]

    def forward(m, b):
        return m(b[0], lm_head_chunk_size=chunk)

    def loss(logits, b):
        if isinstance(logits, list):
            # The script's shift: output n predicts token n + 1.
            logits[-1] = logits[-1][..., :-1, :]
            return utils.chunked_cross_entropy(logits, b[1][..., 1:])
        return utils.chunked_cross_entropy(logits, b[1])

    job = Job(make(model_mod.GPT, base), specs, loss, forward=forward, seq_len=seq)

    def own_lora(lora, quantize):
        """litgpt's LoRA as ``litgpt finetune_lora`` sets it up: ``litgpt.lora.GPT`` from its
        Config with ``lora_r``, ``lora_alpha``, ``lora_dropout`` and a switch per target
        (query, key, value, projection, mlp, head, or the Hugging Face names of those layers;
        ``all-linear``: all but the head), then ``mark_only_lora_as_trainable``. QLoRA
        (``quant``): Lightning Fabric's ``BitsandbytesPrecision``, litgpt's only quantizer —
        every linear layer, the head's too — and, as litgpt 0.5 does after the optimizer is
        made, the embedding swapped for bitsandbytes' ``StableEmbedding``: trained (its
        gradient made each backward) but in no optimizer, so its gradient is never freed."""
        lit_lora = importlib.import_module("litgpt.lora")
        parts = set()
        for t in lora.targets:
            if t == "all-linear":
                parts |= set(LITGPT_LORA) - {"head"}
                continue
            part = LITGPT_HF_TARGETS.get(t, t)
            if part not in LITGPT_LORA:
                raise ReferenceError_(
                    f"{ref}: LoRA target `{t}` is none of litgpt's ({', '.join(LITGPT_LORA)}, or all-linear)"
                )
            parts.add(part)
        cfg = config(
            lit_lora.Config,
            lora_r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            **{f"lora_{p}": True for p in parts},
        )
        model = make(lit_lora.GPT, cfg)
        if lora.quant:
            quantize(model)
        lit_lora.mark_only_lora_as_trainable(model)
        if lora.quant:
            old = model.transformer.wte
            stable = _require("bitsandbytes.nn", "bitsandbytes").StableEmbedding
            model.transformer.wte = build(lambda: stable(old.num_embeddings, old.embedding_dim)).to(
                dtype=old.weight.dtype
            )
            job.unoptimized = frozenset(
                f"transformer.wte.{n}" for n, _ in model.transformer.wte.named_parameters()
            )
        job.model = model
        return model

    job.own_lora = own_lora
    return job


def _mask(batch, index):
    """The attention mask, where the batch carries one (it is then the last tensor)."""
    return {"attention_mask": batch[index]} if len(batch) > index else {}


def py_job(spec, ref, batch_hint):
    """``py:FILE.py:FUNCTION`` or ``py:FILE.py:FUNCTION(key=value,...)``: FUNCTION(batch_size,
    **keys) returns (model, batch, loss_fn); loss_fn(output, batch) gives the loss."""
    m = re.fullmatch(r"(.+):([A-Za-z_][A-Za-z0-9_]*)(?:\((.*)\))?", spec.strip())
    if not m:
        raise ReferenceError_(f"{ref}: expected py:path/to/file.py:function")
    path, func, kw = m.group(1), m.group(2), _kwargs(m.group(3) or "", ref)
    s = importlib.util.spec_from_file_location("gpumem_user_model", path)
    if s is None:
        raise ReferenceError_(f"{ref}: cannot load `{path}`")
    mod = importlib.util.module_from_spec(s)
    try:
        s.loader.exec_module(mod)
    except FileNotFoundError as e:
        raise ReferenceError_(f"{ref}: {e}") from e
    fn = getattr(mod, func, None)
    if fn is None:
        _unknown("py", func, [n for n in dir(mod) if not n.startswith("_")])

    def call(b):
        out = build(lambda: fn(b, **kw))
        if not (isinstance(out, tuple) and len(out) == 3):
            raise ReferenceError_(f"{ref}: {func}(batch_size) must return (model, batch, loss_fn)")
        return out

    model, _, loss = call(batch_hint)

    def specs(b):
        batch = call(b)[1]
        ts = list(batch) if isinstance(batch, (tuple, list)) else [batch]
        return [(tuple(t.shape), t.dtype) for t in ts]

    return Job(model, specs, lambda out, b: loss(out, b if len(b) > 1 else b[0]))


# Live models: ``live:KEY`` names a model object the Python process holding it registered
# (the gpumem package's ``estimate``), with the example batch it was given, if any. The tracer
# runs in a fork of that process, where the object is.
LIVE = {}


def meta_copy(module):
    """A copy of ``module`` whose parameters and buffers are meta tensors of the same shapes,
    dtypes and sharing (tied weights stay tied); the original is not touched, nor its weights
    copied."""
    import copy

    memo = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            if isinstance(t, nn.Parameter):
                meta = nn.Parameter(meta, requires_grad=t.requires_grad)
            memo[id(t)] = meta
    return copy.deepcopy(module, memo)


def _example_job(model, example):
    """A model of the user's own, trained on batches shaped like ``example`` (a tensor or a
    tuple of them, batch first), its loss the mean of its first output tensor."""
    tensors = [example] if isinstance(example, torch.Tensor) else list(example)

    def first(out):
        if isinstance(out, torch.Tensor):
            return out
        return first(next(iter(out.values())) if isinstance(out, dict) else out[0])

    return Job(
        model,
        lambda b: [((b, *t.shape[1:]), t.dtype) for t in tensors],
        lambda out, batch: first(out).float().mean(),
        forward=lambda m, b: m(*b),
    )


def live_job(key, ref, input_shape, seq_len, attention_mask, attention):
    """``live:KEY``: the registered model, copied to meta, trained as its library trains it
    (Hugging Face, timm, torchvision) or on its example batch."""
    if key not in LIVE:
        raise ReferenceError_(f"{ref}: no live model of this key in this process")
    module, example = LIVE[key]
    model = meta_copy(module)
    if attention:
        raise ReferenceError_(
            f"{ref}: --attention applies to references; set the live model's own attn_implementation"
        )
    if example is not None:
        return _example_job(model, example)
    tr = importlib.import_module("transformers") if "transformers" in sys.modules else None
    if tr is not None and isinstance(model, tr.PreTrainedModel):
        name = type(model).__name__
        _hf_config_defaults(model.config, name)
        return hf_model_job(tr, name, ref, model.config, model, seq_len, attention_mask)
    if attention_mask != "none":
        raise ReferenceError_(f"--attention-mask applies to Hugging Face models, not `{ref}`")
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and type(model).__module__.startswith("timm."):
        shape = input_shape or tuple(cfg.get("input_size", (3, 224, 224)))
        return _classification(model, shape, getattr(model, "num_classes", 1000) or 1000)
    where = type(model).__module__
    if where.startswith("torchvision.models"):
        if ".segmentation." in where:
            return _segmentation(model, input_shape or (3, 520, 520))
        if ".video." in where:
            return _classification(model, input_shape or (3, 16, 112, 112), 400)
        return _classification(model, input_shape or (3, 224, 224), 1000)
    raise ReferenceError_(
        f"{type(module).__name__} is not a Hugging Face, timm or torchvision model: give input= (an example batch)"
    )


def resolve(
    ref,
    input_shape=None,
    seq_len=None,
    batch_hint=2,
    attention_mask="none",
    attention=None,
    gpu_capability="8.0",
):
    kind, sep, spec = ref.partition(":")
    if not sep:
        raise ReferenceError_(
            f"`{ref}` is not a model reference (torchvision:NAME, timm:NAME, hf:CLASS(...), hf-code:DIR, smp:ARCH(...), torchtitan:MODEL(flavor=...), litgpt:NAME, py:FILE:FUNCTION)"
        )
    for flag, given, kinds in (
        ("--attention-mask", attention_mask != "none", ("hf", "hf-code", "live")),
        # A checkpoint's own code chooses its attention itself (its config's keys).
        ("--attention", attention, ("hf", "live")),
    ):
        if given and kind not in kinds:
            raise ReferenceError_(f"{flag} applies to Hugging Face models (hf:), not `{ref}`")
    if kind == "torchvision":
        return torchvision_job(spec, ref, input_shape)
    if kind == "timm":
        return timm_job(spec, ref, input_shape)
    if kind == "hf":
        return hf_job(spec, ref, seq_len, attention_mask, attention)
    if kind == "hf-code":
        return hf_code_job(spec, ref, seq_len, attention_mask)
    if kind == "smp":
        return smp_job(spec, ref, input_shape)
    if kind == "py":
        return py_job(spec, ref, batch_hint)
    if kind == "torchtitan":
        return torchtitan_job(spec, ref, seq_len, gpu_capability)
    if kind == "litgpt":
        return litgpt_job(spec, ref, seq_len)
    if kind == "live":
        return live_job(spec, ref, input_shape, seq_len, attention_mask, attention)
    raise ReferenceError_(
        f"unknown model source `{kind}` in `{ref}` (expected torchvision, timm, hf, hf-code, smp, torchtitan, litgpt or py)"
    )
