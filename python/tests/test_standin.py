"""The stand-in CUDA (gpumem_trace.standin): library code asks torch.cuda and gets the chosen
GPU; what it puts "on cuda" is recorded on meta; transformers' own from_pretrained places each
module where its device_map says."""

import warnings

import pytest

torch = pytest.importorskip("torch")

from test_tracer import live_and_peak  # noqa: E402

from gpumem_trace import standin  # noqa: E402
from gpumem_trace.tracer import ModulePaths, Recorder, TraceMode  # noqa: E402

GPU = standin.StandinGpu(name="NVIDIA A100-SXM4-40GB", total_memory=40 << 30, capability=(8, 0))


def recording():
    rec = Recorder()
    return rec, TraceMode(rec, ModulePaths(torch.nn.Module()), "meta")


def test_library_code_sees_the_gpu_and_its_tensors_are_recorded():
    rec, mode = recording()
    available = torch.cuda.is_available()
    with mode, standin.cuda(GPU, rec):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.get_device_name(0) == GPU.name
        assert torch.cuda.get_device_properties(0).total_memory == 40 << 30
        assert torch.cuda.get_device_capability() == (8, 0) and torch.cuda.is_bf16_supported()
        made = [
            torch.empty(1000, device="cuda"),  # 4000 bytes
            torch.zeros(10, 10, device=torch.device("cuda", 0)),  # 400
            torch.ones(5, dtype=torch.float16).cuda(),  # 10
            torch.ones(6).to(0),  # 24
            torch.ones(7).to("cuda:0", torch.float16),  # 14
        ]
        assert all(t.device.type == "meta" for t in made)
        assert torch.cuda.memory_allocated() == 4448 == live_and_peak(rec.events)[0]
        # What library code puts on meta itself (a skeleton before its weights) holds nothing.
        skeleton = torch.empty(1 << 20, device="meta")
        assert skeleton.half().mul(2).numel() == 1 << 20
        assert live_and_peak(rec.events)[0] == 4448
        # Values are placeholders of the right shape, never real.
        assert made[1].numpy().shape == (10, 10) and not made[1].numpy().any()
        del made
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.max_memory_allocated() == 4448
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        assert free == total == 40 << 30
        if _has("transformers"):
            from transformers.utils import is_torch_bf16_gpu_available, is_torch_cuda_available

            assert is_torch_cuda_available() and is_torch_bf16_gpu_available()
    assert [e["ev"] for e in rec.events].count("empty_cache") == 1
    # Forgotten on the way out, cached answers included.
    assert torch.cuda.is_available() == available
    if _has("transformers"):
        from transformers.utils import is_torch_cuda_available

        assert is_torch_cuda_available() == available
    if not available:
        with pytest.raises(RuntimeError):
            torch.empty(1, device="cuda")


def test_a_module_moved_to_the_gpu_keeps_its_tied_weights_once():
    """A CPU→CUDA move swaps each parameter's data in place; tied weights stay one tensor."""
    emb = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    rec, mode = recording()
    with mode, standin.cuda(GPU, rec):
        model.to("cuda")
        assert model[0].weight is model[1].weight and model[0].weight.device.type == "meta"
        assert live_and_peak(rec.events) == (100 * 8 * 4, 100 * 8 * 4)
        model.cuda()  # already there: nothing moves
        model.to(torch.bfloat16)
        assert live_and_peak(rec.events)[0] == 100 * 8 * 2


def _has(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A local checkpoint of a small Llama (safetensors), written here: nothing downloaded."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=4000,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "device_map",
    [
        {"": 0},
        {
            "model.embed_tokens": 0,
            "model.layers.0": 0,
            "model.layers.1": "cpu",
            "model.norm": "cpu",
            "model.rotary_emb": "cpu",
            "lm_head": 0,
        },
    ],
    ids=["one-gpu", "split-with-cpu"],
)
def test_from_pretrained_places_each_module_where_the_device_map_says(checkpoint, device_map):
    """transformers' own from_pretrained on the stand-in: a 16-bit load holds the model once,
    and with a device map only the modules mapped to the GPU are on it."""
    from transformers import LlamaForCausalLM

    def on_gpu(name):
        owner = max((k for k in device_map if name.startswith(k)), key=len)
        return device_map[owner] == 0

    rec, mode = recording()
    with mode, standin.cuda(GPU, rec), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, device_map=device_map
        )
    named = dict(model.named_parameters())
    placed = sum(2 * p.numel() for n, p in named.items() if on_gpu(n))
    live, peak = live_and_peak(rec.events)
    # The rotary embedding's inverse frequencies (a buffer of 64 bytes) are the only other
    # tensor; the load never holds more than its result (one copy of each weight).
    assert placed <= live <= placed + 64 and peak == live
    if len(device_map) > 1:
        everything = sum(2 * p.numel() for p in named.values())
        assert placed < everything - 2 * 64 * 128 * 3  # layer 1's MLP is not on the GPU


def test_a_4bit_load_holds_the_quantized_model_and_one_16bit_weight_at_a_time(checkpoint):
    """transformers' own 4-bit load (nf4, double quantization) on the stand-in, bitsandbytes
    quantizing each weight with its own code: every linear layer but the head ends 4-bit; the
    load stages each linear weight on the GPU in 16 bits once, one at a time, and holds at its
    peak the quantized model so far, that one weight and its block statistics; what it leaves
    is what gpumem's restatement of the load (lora.Linear4bit) holds."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from gpumem_trace import lora

    # A training job's process: bitsandbytes has made no codebook yet (it caches one per process).
    bnb.functional.name2qmap.clear()
    rec, mode = recording()
    four_bit = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    with mode, standin.cuda(GPU, rec), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, device_map={"": 0}, quantization_config=four_bit
        )
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * 7
    assert all(m.weight.bnb_quantized and m.weight.dtype == torch.uint8 for m in layers)
    weights = sorted(2 * m.in_features * m.out_features for m in layers)
    # Each linear weight reaches the GPU in bf16 once (a `_to_copy`), and dies before the next.
    staged, at_once, most = [], set(), 0
    sizes = set(weights)
    for e in rec.events:
        if e["ev"] == "alloc" and e["op"] == "_to_copy" and e["bytes"] in sizes:
            staged.append(e["bytes"])
            at_once.add(e["id"])
            most = max(most, len(at_once))
        elif e["ev"] == "free":
            at_once.discard(e["id"])
    assert sorted(staged) == weights and most == 1 and not at_once
    live, peak = live_and_peak(rec.events)
    # At the peak: the model so far, one staged weight, and its fp32 absmax (a float per 64
    # elements) with its offset-shifted copy, before double quantization makes them bytes.
    largest = weights[-1]
    assert live < peak <= live + largest + 2 * (largest // 2 // 64) * 4
    # gpumem's restatement of the same load holds the same bytes, bitsandbytes' codebooks
    # included (each layer's QuantState holds its own copies).
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(checkpoint))
    lora.quantize(skeleton, lora.Lora(rank=8, alpha=16, targets=("q_proj",), quant="nf4"))
    # Its parameters (embeddings, norms, head) load in bf16; its byte buffers are the 4-bit
    # layers' (the rotary embedding's frequencies are computed on meta: no GPU memory).
    restated = sum(2 * p.numel() for p in skeleton.parameters()) + sum(
        b.numel() for b in skeleton.buffers() if b.dtype == torch.uint8
    )
    assert restated == live
