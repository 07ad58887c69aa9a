"""litgpt's own model, LoRA and loss (``litgpt:NAME``), held to litgpt's code: the trained
parameters are litgpt's count, the head's output is chunked as its fine-tuning step chunks it,
and QLoRA's StableEmbedding trains outside the optimizer as litgpt 0.5 leaves it. litgpt is
installed into both of scripts/test.sh's tracer environments (without its dependencies: see
there); where it is not, these tests are skipped, saying so."""

import re

import pytest
import torch
from test_tracer import allocs, live_and_peak, run, traced
from trainers import requires

pytestmark = requires("litgpt.lora")

# A Llama-shaped litgpt config, small: 2 layers, grouped-query attention, a 1,024-token vocabulary.
SMALL = "Llama-3.2-1B(n_layer=2,n_embd=128,n_head=4,n_query_groups=2,intermediate_size=256,padded_vocab_size=1024,head_size=32)"
KEYS = dict(
    n_layer=2,
    n_embd=128,
    n_head=4,
    n_query_groups=2,
    intermediate_size=256,
    padded_vocab_size=1024,
    head_size=32,
)
BATCH, SEQ, VOCAB, EMBD = 2, 256, 1024, 128
# litgpt's LoRA on the query and the value, rank 8, alpha 16, in bf16.
LORA = ["--precision", "bf16", "--lora-rank", "8", "--lora-alpha", "16"]


def litgpt_flags(*extra):
    return [f"litgpt:{SMALL}", "--batch", str(BATCH), "--seq-len", str(SEQ), *extra]


def trained_by_litgpt(**lora):
    """What ``litgpt finetune_lora`` trains on the same config: its LoRA model's parameters
    left trainable by ``mark_only_lora_as_trainable``."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    with torch.device("meta"):
        model = GPT(Config.from_name("Llama-3.2-1B", **KEYS, **lora))
    mark_only_lora_as_trainable(model)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_the_fine_tuning_step_chunks_the_head_as_litgpt_does(tmp_path):
    from litgpt.model import GPT, Config

    header, evs = traced(litgpt_flags("--precision", "bf16"), tmp_path)
    with torch.device("meta"):
        model = GPT(Config.from_name("Llama-3.2-1B", **KEYS))
    assert header["parameters"] == sum(p.numel() for p in model.parameters())
    # The head's output: SEQ / 128 chunks of 128 positions, bf16, every iteration — never the
    # whole (BATCH, SEQ, VOCAB) at once.
    chunk, whole = BATCH * 128 * VOCAB * 2, BATCH * SEQ * VOCAB * 2
    head = [e for e in allocs(evs, bytes=chunk) if e["phase"] == "forward"]
    assert len(head) >= (SEQ // 128) * header["iterations"]
    tensors = [e for e in allocs(evs) if e["phase"] == "forward" and e["category"] != "workspace"]
    assert max(e["bytes"] for e in tensors) < whole


def test_pretraining_step_keeps_the_whole_logits(tmp_path):
    ref = f"litgpt:{SMALL[:-1]},lm_head_chunk_size=0)"
    _, evs = traced(
        [ref, "--batch", str(BATCH), "--seq-len", str(SEQ), "--precision", "bf16"], tmp_path
    )
    whole = BATCH * SEQ * VOCAB * 2
    assert [e for e in allocs(evs, bytes=whole) if e["phase"] == "forward"]


def test_lora_trains_what_litgpt_trains(tmp_path):
    """litgpt's own LoRA (its fused query-key-value layer padded with zeros where a part has no
    LoRA), given litgpt's names or the Hugging Face ones: litgpt's trainable count, and only
    those get gradients and AdamW's state."""
    from gpumem_trace.lora import Lora
    from gpumem_trace.models import resolve

    trainable = trained_by_litgpt(lora_r=8, lora_alpha=16, lora_query=True, lora_value=True)
    header, evs = traced(
        litgpt_flags(*LORA, "--lora-dropout", "0.05", "--lora-targets", "query,value"), tmp_path
    )
    assert header["parameters"] == trainable
    grads = sum(e["bytes"] for e in allocs(evs, category="gradient"))
    state = sum(e["bytes"] for e in allocs(evs, category="optimizer_state"))
    assert (grads, state) == (header["iterations"] * trainable * 2, 2 * trainable * 2)
    # The zero padding of the fused layer's key part: a (BATCH, SEQ, query+key+value) tensor.
    qkv = (4 + 2 + 2) * 32
    assert allocs(evs, op="new_zeros", bytes=BATCH * SEQ * qkv * 2)
    # The Hugging Face names of the same layers build the same model.
    model = resolve(f"litgpt:{SMALL}", seq_len=SEQ).own_lora(
        Lora(rank=8, alpha=16, targets=("q_proj", "v_proj")), lambda m: None
    )
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable
    assert trained_by_litgpt(lora_r=8, lora_mlp=True) != trainable


def test_qlora_embedding_trains_outside_the_optimizer(tmp_path):
    """QLoRA as litgpt 0.5 sets it up: every linear layer in 4 bits (the head's too), then the
    embedding swapped for bitsandbytes' StableEmbedding after the optimizer is made — its
    gradient made by the first backward and never freed; the optimizer's state is the LoRA
    factors' alone."""
    flags = litgpt_flags(
        *LORA, "--lora-targets", "query,value", "--lora-quant", "nf4", "--lora-single-quant"
    )
    header, evs = traced(flags, tmp_path)
    trainable = trained_by_litgpt(lora_r=8, lora_alpha=16, lora_query=True, lora_value=True)
    state = sum(e["bytes"] for e in allocs(evs, category="optimizer_state"))
    assert state == 2 * trainable * 2
    embedding = VOCAB * EMBD * 2
    made = allocs(evs, category="gradient", bytes=embedding)
    assert len(made) == 1, "made once, accumulated into after"
    freed = {e["id"] for e in evs if e["ev"] == "free"}
    assert made[0]["id"] not in freed
    live, _ = live_and_peak(evs)
    assert live >= embedding


def test_litgpt_refusals(tmp_path):
    from gpumem_trace.lora import Lora
    from gpumem_trace.models import ReferenceError_, resolve

    for ref, seq, says in (
        ("litgpt:Llama-3.2-1X", 64, "unknown litgpt model `Llama-3.2-1X`; did you mean"),
        ("litgpt:pythia-14m(no_such_key=1)", 64, "litgpt's Config"),
        ("litgpt:pythia-14m", 4096, "longer than litgpt's block_size 512"),
    ):
        with pytest.raises(ReferenceError_, match=re.escape(says)):
            resolve(ref, seq_len=seq)
    job = resolve("litgpt:pythia-14m", seq_len=64)
    with pytest.raises(ReferenceError_, match="LoRA target `dense` is none of litgpt's"):
        job.own_lora(Lora(rank=8, alpha=8, targets=("dense",)), lambda m: None)
    # A refusal leaves the tracer with exit code 2, its message on stderr.
    p, _ = run(["litgpt:Llama-3.2-1X", "--batch", "1", "--seq-len", "64"], tmp_path)
    assert p.returncode == 2 and "unknown litgpt model" in p.stderr, p.stderr
