"""Tests of gpumem_trace: traces are valid, CUDA behaviour is applied, errors are clear."""

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PKG = HERE.parent
FIX = HERE / "fixtures" / "user_models.py"


def run(args, tmp_path, timeout=120):
    """``python -m gpumem_trace ARGS --out FILE``, as a fork of the tracer pool gpumem runs
    (``gpumem_trace.pool``: torch and the model libraries imported once, not once per trace —
    most of a small trace's time): the completed process (stdout and stderr both the fork's
    log) and the trace's events."""
    import contextlib
    import io

    from gpumem_trace.__main__ import flags
    from gpumem_trace.request import from_flags

    out = tmp_path / "t.jsonl"
    argv = [*args, "--out", str(out)]
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            request = from_flags(flags().parse_args(argv))
    except SystemExit as e:  # argparse's refusal, its usage on stderr
        return subprocess.CompletedProcess(argv, e.code, "", messages.getvalue()), []
    except ValueError as e:
        return subprocess.CompletedProcess(argv, 2, "", f"gpumem_trace: {e}\n"), []
    log = tmp_path / "t.log"
    code = POOL.trace(request, log, timeout)
    text = log.read_text()
    events = [json.loads(line) for line in out.read_text().splitlines()] if code == 0 else []
    return subprocess.CompletedProcess(argv, code, text, text), events


class Pool:
    """The tests' one ``gpumem_trace.pool``, started at its first trace, ended with the tests."""

    def __init__(self):
        self.process, self.ids = None, 0

    def trace(self, request, log, timeout):
        import select

        if self.process is None:
            import atexit

            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpumem_trace.pool"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONPATH=str(PKG)),
            )
            atexit.register(self.process.stdin.close)
        self.ids += 1
        line = json.dumps({"id": self.ids, "request": request, "log": str(log)})
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        if not select.select([self.process.stdout], [], [], timeout)[0]:
            self.process.stdin.write(json.dumps({"kill": self.ids}) + "\n")
            self.process.stdin.flush()
            self.process.stdout.readline()
            raise subprocess.TimeoutExpired(request["model"], timeout)
        answer = json.loads(self.process.stdout.readline())
        assert answer["id"] == self.ids, answer
        return answer["code"]


POOL = Pool()


def traced(args, tmp_path):
    """A trace that must succeed: its header and events, checked by check_valid."""
    p, ev = run(args, tmp_path)
    assert p.returncode == 0, p.stderr
    return check_valid(ev)


def check_valid(events):
    header, evs = events[0], events[1:]
    assert header["format"] == "gpumem-trace" and header["version"] == 2
    live, seen = set(), set()
    for e in evs:
        if e["ev"] == "alloc":
            assert e["id"] not in live and e["bytes"] > 0
            live.add(e["id"])
            seen.add(e["id"])
        elif e["ev"] == "free":
            assert e["id"] in live, f"free of {e['id']} not live"
            live.remove(e["id"])
    assert header["iterations"] == sum(1 for e in evs if e["ev"] == "iteration") >= 2
    return header, evs


def strategy_of(header):
    """A header's strategy as the tracer's flags name it, and its ranks (its mesh's product)."""
    s = header["options"]["strategy"]
    name = f"zero{s['stage']}" if s["kind"] == "zero" else s["kind"]
    return name, math.prod(s["mesh"].values())


def allocs(evs, **match):
    return [e for e in evs if e["ev"] == "alloc" and all(e.get(k) == v for k, v in match.items())]


def live_and_peak(evs):
    """Bytes still allocated at the end of a trace, and the most allocated at once."""
    sizes, live, peak = {}, 0, 0
    for e in evs:
        if e["ev"] == "alloc":
            sizes[e["id"]] = e["bytes"]
            live += e["bytes"]
            peak = max(peak, live)
        elif e["ev"] == "free":
            live -= sizes.pop(e["id"])
    return live, peak


def test_tiny_model_trace_is_valid_and_categorised(tmp_path):
    header, evs = traced([f"py:{FIX}:tiny", "--batch", "8"], tmp_path)
    assert header["parameters"] == 16 * 32 + 32 + 32 * 4 + 4
    # Adam: two state tensors per parameter, created once.
    assert len(allocs(evs, category="optimizer_state")) == 2 * 4
    # Gradients are re-created every iteration (zero_grad(set_to_none=True)).
    assert len(allocs(evs, category="gradient")) == 4 * header["iterations"]
    # CUDA's fused dropout keeps a 1-byte mask: 8 x 32 bytes.
    assert any(
        e["op"] == "native_dropout" and e["bytes"] == 8 * 32 for e in evs if e["ev"] == "alloc"
    )
    # One cuBLAS workspace per thread (main + autograd), and the cuBLASLt one of linear's
    # matmul with its bias fused (forward, main thread).
    ops = sorted(e["op"] for e in allocs(evs, category="workspace"))
    assert ops == ["cublas_workspace", "cublas_workspace", "cublaslt_workspace"], ops
    assert any(e["ev"] == "op" and e["op"] == "mm" and e["flops"] > 0 for e in evs)


def test_options_change_the_trace(tmp_path):
    _, sgd = run([f"py:{FIX}:tiny", "--batch", "8", "--optimizer", "sgd"], tmp_path)
    assert not allocs(sgd[1:], category="optimizer_state")
    _, acc = run([f"py:{FIX}:tiny", "--batch", "8", "--grad-accum", "2"], tmp_path)
    fwd = [e for e in acc[1:] if e["ev"] == "alloc" and e["category"] == "input_batch"]
    assert len(fwd) == 2 * 2 * 3  # two tensors, two micro-batches, three iterations


def test_amp_fp16_casts_weights_and_scales_the_loss(tmp_path):
    _, evs = traced([f"py:{FIX}:tiny", "--batch", "8", "--precision", "amp-fp16"], tmp_path)
    casts = [e for e in allocs(evs, phase="forward") if e["op"] == "_to_copy"]
    assert any(e["bytes"] == 16 * 32 * 2 for e in casts), "fp16 copy of the first weight"
    assert any(
        e["op"] == "_amp_foreach_non_finite_check_and_unscale_" for e in evs if e["ev"] == "op"
    )


def test_reentrant_checkpoints_recompute_under_the_emulated_autocast(tmp_path):
    """A reentrant checkpoint (Hugging Face's default before transformers 5) recomputes its
    segment in backward under the forward's autocast, as on a GPU: the recomputed linears'
    outputs are bf16, as in forward, never fp32."""
    _, evs = traced(
        [f"py:{FIX}:reentrant_checkpoints", "--batch", "8", "--precision", "amp-bf16"], tmp_path
    )
    linear = lambda phase: {e["bytes"] for e in allocs(evs, phase=phase) if e["op"] == "addmm"}
    assert 8 * 64 * 2 in linear("forward") and 8 * 64 * 2 in linear("backward")
    assert 8 * 64 * 4 not in linear("backward")


def test_attention_uses_the_kernel_the_gpu_runs(tmp_path):
    def kernels(*extra):
        _, evs = traced([f"py:{FIX}:attention", "--batch", "2", *extra], tmp_path)
        return {e["op"] for e in evs if e["ev"] == "op" and "scaled_dot_product" in e["op"]}

    # An A100 (no cuDNN preference there in any release): bf16 runs flash, fp32 memory-efficient.
    assert "_scaled_dot_product_flash_attention" in kernels(
        "--precision", "amp-bf16", "--gpu-capability", "8.0"
    )
    assert "_scaled_dot_product_efficient_attention" in kernels("--gpu-capability", "8.0"), (
        "fp32 cannot use flash"
    )
    # A V100 has no bf16 fused kernel; a forced math kernel materialises the attention weights.
    assert not kernels("--precision", "amp-bf16", "--gpu-capability", "7.0")
    assert not kernels("--sdpa", "math")
    p, _ = run([f"py:{FIX}:attention", "--batch", "2", "--gpu-capability", "nine"], tmp_path)
    assert p.returncode == 2 and "gpu_capability `nine`" in p.stderr


def test_sdpa_rules_by_release_and_gpu():
    """The choice PyTorch's select_sdp_backend makes, per torch release and GPU (docs/sdpa.md)."""
    import torch

    from gpumem_trace import sdpa

    def t(heads, dtype, grad=True):
        return torch.empty(2, heads, 128, 64, device="meta", dtype=dtype, requires_grad=grad)

    def choose(
        torch_version,
        cap,
        q_heads=8,
        kv_heads=8,
        dtype=torch.bfloat16,
        mask=None,
        cudnn=91900,
        compiled=None,
        gqa=None,
    ):
        stack = sdpa.Stack(torch_version, cap, cudnn, compiled or cudnn, 13)
        call = sdpa.Call(
            t(q_heads, dtype),
            t(kv_heads, dtype),
            t(kv_heads, dtype),
            mask,
            0.0,
            mask is None,
            kv_heads != q_heads if gqa is None else gqa,
        )
        return sdpa.choose(call, stack)

    h200, a100, v100 = (9, 0), (8, 0), (7, 0)
    assert choose((2, 11, 0), h200) == "cudnn", "2.11 with cuDNN 9.19 prefers cuDNN on Hopper"
    assert choose((2, 11, 0), h200, cudnn=91002) == "flash", "not with a cuDNN older than 9.15"
    assert choose((2, 9, 1), h200, cudnn=91002, compiled=90800) == "flash", (
        "PyPI's 2.9 was built against cuDNN 9.8"
    )
    assert choose((2, 9, 1), h200, cudnn=91002, compiled=91002) == "cudnn"
    assert choose((2, 11, 0), a100) == "flash"
    assert choose((2, 11, 0), h200, q_heads=8, kv_heads=2) == "cudnn", (
        "cuDNN takes grouped-query attention from 2.8"
    )
    assert choose((2, 7, 0), h200, q_heads=8, kv_heads=2) == "flash", "flash takes it from 2.5"
    assert choose((2, 4, 0), a100, q_heads=8, kv_heads=2) == "math", "2.4: no fused kernel has GQA"
    assert choose((2, 11, 0), h200, dtype=torch.float32) == "efficient"
    assert choose((2, 11, 0), h200, q_heads=8, kv_heads=2, dtype=torch.float32) == "math", (
        "efficient has no GQA before 2.14"
    )
    assert choose((2, 14, 0), h200, q_heads=8, kv_heads=2, dtype=torch.float32) == "efficient"
    mask = torch.empty(2, 1, 128, 128, device="meta", dtype=torch.bool)
    assert choose((2, 9, 1), a100, mask=mask) == "efficient", "flash takes no mask"
    assert choose((2, 11, 0), v100, dtype=torch.bfloat16) == "math"
    assert choose((2, 11, 0), v100, dtype=torch.float16) == "efficient"


def test_llama_style_model_under_mixed_precision(tmp_path):
    """Grouped-query attention, rotary embeddings (fp32 cos/sin promote q and k) and RMSNorm under
    autocast: SDPA is on autocast's lower-precision list, so a fused kernel runs on bf16."""
    pytest.importorskip("transformers")
    ref = "hf:LlamaForCausalLM(hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size=1000)"
    _, evs = traced(
        [
            ref,
            "--batch",
            "2",
            "--seq-len",
            "64",
            "--precision",
            "amp-bf16",
            "--gpu-capability",
            "9.0",
        ],
        tmp_path,
    )
    ops = {e["op"] for e in evs if e["ev"] == "op"}
    assert ops & {"_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"}, (
        "a fused kernel, not math"
    )
    # On an A100 flash runs; its backward's softmax_d [B, H, round128(L)] fp32 comes and goes.
    _, evs = traced(
        [
            ref,
            "--batch",
            "2",
            "--seq-len",
            "64",
            "--precision",
            "amp-bf16",
            "--gpu-capability",
            "8.0",
        ],
        tmp_path,
    )
    softmax_d = [
        e
        for e in allocs(evs, op="_scaled_dot_product_flash_attention_backward")
        if e["bytes"] == 2 * 4 * 128 * 4
    ]
    assert softmax_d and all(
        any(f["ev"] == "free" and f["id"] == e["id"] for f in evs) for e in softmax_d
    )


def test_hugging_face_outputs_dropped_as_the_trainer_does(tmp_path):
    """`loss = model(**batch).loss` frees the logits before backward; a loop holding `outputs`
    keeps them through it: the peak differs by about the logits' size."""
    pytest.importorskip("transformers")
    ref = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)"

    def peak(*extra):
        _, evs = traced([ref, "--batch", "4", "--seq-len", "128", *extra], tmp_path)
        return live_and_peak(evs)[1]

    logits = 4 * 128 * 8000 * 4
    assert abs(peak("--outputs", "kept") - peak() - logits) < logits * 0.05


def test_allocations_name_their_module(tmp_path):
    header, evs = traced([f"py:{FIX}:tiny", "--batch", "8"], tmp_path)
    forward = {e.get("module") for e in allocs(evs, phase="forward", op="addmm")}
    backward = {e.get("module") for e in allocs(evs, phase="backward", op="mm")}
    assert forward == {"0", "3"} and backward <= {"0", "3"} and backward, (forward, backward)
    assert all("module" not in e for e in allocs(evs, phase="optimizer"))


def test_pure_low_precision_training(tmp_path):
    """--precision bf16: weights, gradients and optimizer state in bf16, inputs too."""
    header, evs = traced([f"py:{FIX}:tiny", "--batch", "8", "--precision", "bf16"], tmp_path)
    params = sum(e["bytes"] for e in allocs(evs, category="parameter"))
    state = sum(e["bytes"] for e in allocs(evs, category="optimizer_state"))
    assert params == 2 * header["parameters"] and state == 2 * 2 * header["parameters"]
    assert any(e["bytes"] == 8 * 16 * 2 for e in allocs(evs, category="input_batch"))


def test_several_batch_sizes_in_one_run(tmp_path):
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    env = dict(os.environ, PYTHONPATH=str(PKG))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem_trace",
            f"py:{FIX}:tiny",
            "--batch",
            "4",
            "6",
            "--out",
            *map(str, outs),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    heads = [json.loads(o.read_text().splitlines()[0]) for o in outs]
    assert [h["batch_size"] for h in heads] == [4, 6]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem_trace",
            f"py:{FIX}:tiny",
            "--batch",
            "4",
            "6",
            "--out",
            str(outs[0]),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2 and "2 batch sizes but 1 output files" in p.stderr


def test_value_dependent_ops_are_answered(tmp_path):
    traced([f"py:{FIX}:data_dependent", "--batch", "4"], tmp_path)


def test_unknown_model_lists_close_matches(tmp_path):
    pytest.importorskip("timm")
    p, _ = run(["timm:resnet5O", "--batch", "2"], tmp_path)
    assert p.returncode == 2
    assert "unknown timm model `resnet5O`; did you mean resnet50" in p.stderr


def test_import_failure_is_reported(tmp_path):
    p, _ = run([f"py:{HERE / 'fixtures' / 'broken_import.py'}:model", "--batch", "2"], tmp_path)
    assert p.returncode == 3
    assert "ModuleNotFoundError" in p.stderr and "a_module_that_does_not_exist" in p.stderr


def test_exception_inside_forward_is_reported(tmp_path):
    p, _ = run([f"py:{FIX}:raises", "--batch", "2"], tmp_path)
    assert p.returncode == 3
    assert "failed while tracing: ValueError: boom" in p.stderr and "user_models.py" in p.stderr


@pytest.mark.parametrize("fixture", ["slow", "slow_to_build", "swallows_an_alarm"])
def test_timeout(tmp_path, fixture):
    # slow_to_build: the build's meta-device fallback must not swallow the alarm and build again;
    # swallows_an_alarm: one alarm lost in the model's own fallback, the next ends the trace
    p, _ = run([f"py:{FIX}:{fixture}", "--batch", "2", "--timeout", "1"], tmp_path, timeout=60)
    assert p.returncode == 4
    assert "timed out after 1 s" in p.stderr


def test_bad_options(tmp_path):
    # What a person types is checked (gpumem's requests are checked where they are made); a
    # failure is reported once.
    p, _ = run([f"py:{FIX}:tiny", "--batch", "0"], tmp_path)
    assert p.returncode == 2
    p, _ = run(["resnet50", "--batch", "2"], tmp_path)
    assert p.returncode == 2 and "is not a model reference" in p.stderr
    assert p.stderr.count("is not a model reference") == 1
    p, _ = run([f"py:{FIX}:tiny", "--batch", "2", "--depths", "1", "3"], tmp_path)
    assert p.returncode == 2 and "--depths 1 3: distinct depths of at least 2" in p.stderr
    p, _ = run([f"py:{FIX}:tiny", "--batch", "8", "--data-parallel", "0"], tmp_path)
    assert p.returncode == 2 and "--data-parallel" in p.stderr


def test_torchvision_model(tmp_path):
    pytest.importorskip("torchvision")
    header, _ = traced(["torchvision:resnet18", "--batch", "2", "--input", "3x64x64"], tmp_path)
    assert header["parameters"] == 11689512


def test_hugging_face_model_without_the_hub(tmp_path):
    pytest.importorskip("transformers")
    ref = "hf:BertForMaskedLM(hidden_size=64,num_hidden_layers=2,num_attention_heads=2,intermediate_size=128,vocab_size=1000)"
    header, _ = traced([ref, "--batch", "2", "--seq-len", "32"], tmp_path)
    assert header["options"]["seq_len"] == 32


def test_a_checkpoint_runs_its_own_code(tmp_path):
    """``hf-code:DIR``: a checkpoint whose model is only in its own modeling files (its
    config's ``auto_map``) is built by that code, offline, and trained as a causal language
    model — its own loss included (this one's shifted copy of the logits)."""
    pytest.importorskip("transformers")
    code = HERE / "fixtures" / "remote_code"
    batch, seq, hidden, vocab, layers = 2, 64, 64, 1000, 2
    _, evs = traced([f"hf-code:{code}", "--batch", str(batch), "--seq-len", str(seq)], tmp_path)
    blocks = layers * (hidden * 4 * hidden + 4 * hidden + 4 * hidden * hidden + hidden)
    params = vocab * hidden + blocks + hidden * vocab
    assert sum(e["bytes"] for e in allocs(evs, category="parameter")) == 4 * params
    shifted = batch * (seq - 1) * vocab * 4
    assert allocs(evs, op="clone", bytes=shifted), "the model's own shifted copy of the logits"
    # Its loss is its own code's, not transformers' loss_function: --compile cannot take it.
    p, _ = run([f"hf-code:{code}", "--batch", "1", "--seq-len", "16", "--compile"], tmp_path)
    assert p.returncode == 2 and "computes its loss without its loss_function" in p.stderr
    # A directory whose config names no code of its own is refused in one line.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    p, _ = run([f"hf-code:{plain}", "--batch", "1"], tmp_path)
    assert p.returncode == 2 and "auto_map names no model class" in p.stderr, p.stderr


def test_data_parallel_traces_gpu0(tmp_path):
    """DataParallel over 2 GPUs at batch 8: GPU 0 runs 4 rows, gathers the whole batch's output,
    and gets its gradients as one flat reduce_add_coalesced buffer per step."""
    header, evs = traced([f"py:{FIX}:tiny", "--batch", "8", "--data-parallel", "2"], tmp_path)
    assert header["options"]["data_parallel"] == 2 and header["batch_size"] == 8
    _, direct = run([f"py:{FIX}:tiny", "--batch", "4"], tmp_path)
    fwd = lambda es: sorted(e["bytes"] for e in allocs(es, phase="forward", op="addmm"))
    assert fwd(evs) == fwd(direct[1:]), "GPU 0's replica runs half the batch"
    gathered = [
        e
        for e in allocs(evs, phase="forward")
        if e["op"] in ("empty", "new_empty") and e["category"] != "input_batch"
    ]
    assert any(e["bytes"] == 8 * 4 * 4 for e in gathered), (
        "the full batch's logits gathered on GPU 0"
    )
    grads = allocs(evs, category="gradient")
    assert len(grads) == header["iterations"]
    assert all(g["bytes"] == header["parameters"] * 4 for g in grads)


def test_torchvision_segmentation_and_video_models(tmp_path):
    pytest.importorskip("torchvision")
    # Segmentation: per-pixel targets, the aux head's loss too; no backbone weights downloaded.
    _, evs = traced(
        [
            "torchvision:fcn_resnet50(aux_loss=True,num_classes=5)",
            "--batch",
            "2",
            "--input",
            "3x64x64",
        ],
        tmp_path,
    )
    assert any(e["bytes"] == 2 * 64 * 64 * 8 for e in allocs(evs, category="input_batch")), (
        "int64 mask of 2x64x64"
    )
    # Video: 16-frame clips at the weights' crop size.
    _, evs = traced(["torchvision:r3d_18", "--batch", "1"], tmp_path)
    assert any(e["bytes"] == 3 * 16 * 112 * 112 * 4 for e in allocs(evs, category="input_batch"))
    # Detection needs targets: a clear refusal.
    p, _ = run(["torchvision:maskrcnn_resnet50_fpn", "--batch", "1"], tmp_path)
    assert p.returncode == 2 and "detection models train on per-image targets" in p.stderr


def test_segmentation_models_pytorch(tmp_path):
    pytest.importorskip("segmentation_models_pytorch")
    _, evs = traced(
        [
            "smp:Unet(encoder_name=resnet18,classes=3,loss=dice)",
            "--batch",
            "2",
            "--input",
            "3x64x64",
        ],
        tmp_path,
    )
    assert any(e["bytes"] == 2 * 64 * 64 * 8 for e in allocs(evs, category="input_batch")), (
        "int64 class map"
    )
    p, _ = run(["smp:Unett", "--batch", "2"], tmp_path)
    assert p.returncode == 2 and "did you mean unet" in p.stderr
    p, _ = run(["smp:Unet(loss=focal)", "--batch", "2"], tmp_path)
    assert p.returncode == 2 and "loss `focal` is not ce or dice" in p.stderr


def test_validation_pass(tmp_path):
    """Two eval batches after training; without no_grad each output keeps its graph, so more
    lives at once. No kernels are recorded for it (utilization is the training step's)."""

    def validation_peak(mode):
        header, evs = traced([f"py:{FIX}:tiny", "--batch", "64", "--validate", mode], tmp_path)
        assert header["options"]["validate"] == mode
        last = max(i for i, e in enumerate(evs) if e["ev"] == "iteration")
        sizes, live, peak = {}, 0, 0
        for i, e in enumerate(evs):
            if e["ev"] == "alloc":
                sizes[e["id"]] = e["bytes"]
                live += e["bytes"]
            elif e["ev"] == "free":
                live -= sizes[e["id"]]
            if i > last:
                peak = max(peak, live)
                assert e["ev"] != "op"
        assert (
            sum(1 for e in evs[last:] if e["ev"] == "alloc" and e["category"] == "input_batch")
            == 2 * 2
        )
        return peak

    assert validation_peak("grad") > validation_peak("no-grad")


def test_amp_on_models_with_boolean_dispatch_functions(tmp_path):
    """F.max_pool2d is a boolean_dispatch wrapper: autocast must not recurse into it."""
    pytest.importorskip("torchvision")
    for precision in ("amp-fp16", "amp-bf16"):
        traced(
            [
                "torchvision:resnet18",
                "--batch",
                "2",
                "--input",
                "3x32x32",
                "--precision",
                precision,
            ],
            tmp_path,
        )


def test_checkpointing_models_without_a_switch(tmp_path):
    """torchvision models have no checkpointing switch: every repeated block is checkpointed,
    so backward recomputes their convolutions; a model without repeated blocks is refused."""
    pytest.importorskip("torchvision")

    def backward_convs(extra):
        _, evs = traced(
            ["torchvision:resnet18", "--batch", "2", "--input", "3x32x32", *extra], tmp_path
        )
        return sum(
            1
            for e in evs
            if e["ev"] == "alloc" and e["phase"] == "backward" and e["op"] == "convolution"
        )

    assert backward_convs([]) == 0 < backward_convs(["--checkpointing"])
    p, _ = run(
        ["torchvision:vgg11", "--batch", "2", "--input", "3x32x32", "--checkpointing"], tmp_path
    )
    assert p.returncode == 2 and "needs repeated blocks" in p.stderr


def test_checkpointing_with_mixed_precision(tmp_path):
    """Checkpoint recomputes in backward under the forward's autocast state, so the recomputed
    tensors match (else torch.utils.checkpoint raises) and are low-precision casts again. A
    recomputation stopped early (once backward has what it needs) still clears the cast cache,
    as leaving torch.autocast does: every step's forward casts each weight again."""
    pytest.importorskip("torchvision")
    _, evs = traced(
        [
            "torchvision:resnet18",
            "--batch",
            "2",
            "--input",
            "3x32x32",
            "--precision",
            "amp-fp16",
            "--checkpointing",
        ],
        tmp_path,
    )
    recast = [e for e in allocs(evs, phase="backward") if e["op"] == "_to_copy"]
    assert recast, "weights cast to fp16 again for the recomputation"
    ref = "hf:LlamaForCausalLM(hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=1000)"
    _, evs = traced(
        [ref, "--batch", "2", "--seq-len", "32", "--precision", "amp-bf16", "--checkpointing"],
        tmp_path,
    )
    casts = [0]
    for e in evs:
        if e["ev"] == "iteration":
            casts.append(0)
        elif e["ev"] == "alloc" and e["phase"] == "forward" and e["op"] == "_to_copy":
            casts[-1] += 1
    assert casts[0] == casts[1] == casts[2], casts


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
def test_selective_checkpointing_saves_matmuls(tmp_path, precision):
    """--checkpointing --selective (op-level SAC): each block keeps its matmul and attention
    outputs and recomputes the rest, so its peak lies between full checkpointing's and none's.
    Under autocast the recomputation's casts replay the forward's (torch 2.15 checks)."""
    ref = "hf:LlamaForCausalLM(hidden_size=256,intermediate_size=688,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,vocab_size=1000)"

    def peak(*extra):
        _, evs = traced(
            [ref, "--batch", "4", "--seq-len", "256", "--precision", precision, *extra], tmp_path
        )
        return live_and_peak(evs)[1]

    none, full, selective = peak(), peak("--checkpointing"), peak("--checkpointing", "--selective")
    assert full < selective < none, (full, selective, none)


def test_convolutions_name_their_workspaces(tmp_path):
    """Each convolution pass is a `workspace` event keyed by its configuration (batch apart),
    where cuDNN takes it: after the forward's output; in backward after grad_input (data pass)
    and after grad_weight (filter pass). The first layer's input needs no gradient: no data pass."""
    pytest.importorskip("torchvision")
    _, evs = traced(
        ["torchvision:resnet18", "--batch", "3", "--input", "3x32x32", "--channels-last"], tmp_path
    )
    ws = [e for e in evs if e["ev"] == "workspace"]
    first = [e for e in ws if e.get("module") == "conv1"]
    assert {e["pass"] for e in first} == {"fwd", "bwd_filter"}
    c = first[0]["conv"]
    assert (
        c
        == "in=3x32x32;w=64x3x7x7;stride=2x2;pad=3x3;dil=1x1;groups=1;dtype=float32;layout=channels_last"
    ), c
    assert all(e["n"] == 3 for e in ws)
    # 20 convolutions (17 + 3 downsample) per step: 20 forward, 20 filter, 19 data passes.
    per_step = len(ws) // 3
    assert per_step == 59, per_step
    # Order in backward: grad_input, its workspace, grad_weight, its workspace.
    i = next(k for k, e in enumerate(evs) if e["ev"] == "workspace" and e["pass"] == "bwd_data")
    assert evs[i - 1]["ev"] == "alloc" and evs[i - 1]["op"] == "convolution_backward"
    assert (
        evs[i + 1]["ev"] == "alloc"
        and evs[i + 2]["ev"] == "workspace"
        and evs[i + 2]["pass"] == "bwd_filter"
    )


def test_probe_lists_a_jobs_convolutions_without_a_gpu(tmp_path):
    pytest.importorskip("torchvision")
    out = tmp_path / "convs.json"
    env = dict(os.environ, PYTHONPATH=str(PKG))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem_trace.probe",
            "--list",
            "--models",
            "torchvision:resnet18:4:amp-bf16:3x32x32",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    convs = json.loads(out.read_text())
    assert len({c["config"] for c in convs}) == len(convs) and all(c["n"] == 4 for c in convs)
    assert all("dtype=bfloat16" in c["config"] for c in convs), "autocast runs convolutions in bf16"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem_trace.probe",
            "--list",
            "--models",
            "resnet18",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 2 and "MODEL:BATCH" in bad.stderr


LLAMA = "hf:LlamaForCausalLM(hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size=1000)"
# Narrower and with a larger vocabulary: where the head and the loss dominate.
LLAMA_16K = "hf:LlamaForCausalLM(hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=16000)"


@pytest.mark.parametrize(
    "ref,targets",
    [
        ("hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)", ["c_attn"]),  # Conv1D
        (LLAMA, ["q_proj", "v_proj"]),
        (LLAMA, "all-linear"),  # every linear layer but lm_head
        (
            "hf:BertForMaskedLM(hidden_size=64,num_hidden_layers=2,num_attention_heads=2,intermediate_size=128,vocab_size=1000)",
            ["query", "value"],
        ),
    ],
)
def test_lora_trains_what_peft_trains(tmp_path, ref, targets):
    """LoRA as PEFT sets it up: the trainable parameters are PEFT's count on the same model, and
    on the event stream only they get gradients (each iteration) and Adam's two state tensors —
    the frozen weights get neither."""
    peft = pytest.importorskip("peft")
    from gpumem_trace.models import resolve

    names = targets if isinstance(targets, str) else ",".join(targets)
    header, evs = traced(
        [
            ref,
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--lora-rank",
            "8",
            "--lora-alpha",
            "16",
            "--lora-targets",
            names,
            "--lora-dropout",
            "0.05",
        ],
        tmp_path,
    )
    model = resolve(ref, seq_len=32).model
    trainable, total = peft.get_peft_model(
        model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=targets)
    ).get_nb_trainable_parameters()
    assert header["parameters"] == trainable < total
    grads = sum(e["bytes"] for e in allocs(evs, category="gradient"))
    state = sum(e["bytes"] for e in allocs(evs, category="optimizer_state"))
    assert (grads, state) == (header["iterations"] * trainable * 4, 2 * trainable * 4)


def test_lora_refuses_what_it_cannot_wrap(tmp_path):
    p, _ = run(
        [
            LLAMA_16K,
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--lora-rank",
            "8",
            "--lora-targets",
            "nothing_here",
        ],
        tmp_path,
    )
    assert p.returncode == 2 and "no module matches the LoRA targets nothing_here" in p.stderr
    p, _ = run(
        [
            LLAMA_16K,
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--lora-rank",
            "8",
            "--lora-targets",
            "embed_tokens",
        ],
        tmp_path,
    )
    assert p.returncode == 2 and "is a Embedding" in p.stderr


@pytest.mark.parametrize(
    "ref,targets,precision",
    [
        (LLAMA, ["q_proj", "v_proj"], "amp-bf16"),
        ("hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)", ["c_attn"], "fp32"),
        (LLAMA, "all-linear", "bf16"),
    ],
)
def test_lora_steps_as_peft_does(tmp_path, monkeypatch, ref, targets, precision):
    """The tracer's LoRA and PEFT's own (get_peft_model on the same model, traced in the same
    loop) allocate the same: every event's size, in order."""
    peft = pytest.importorskip("peft")
    from gpumem_trace import loop
    from gpumem_trace.lora import Lora

    def sizes(path):
        return [
            (e["ev"], e.get("bytes"), e.get("category"))
            for e in map(json.loads, open(path).read().splitlines()[1:])
            if e["ev"] in ("alloc", "free")
        ]

    names = (targets,) if isinstance(targets, str) else tuple(targets)
    opts = loop.TraceOptions(
        model=ref, batch=4, seq_len=64, precision=precision, lora=Lora(8, 16.0, names, 0.05)
    )
    loop.trace_training(opts, str(tmp_path / "ours.jsonl"))
    resolve = loop.resolve

    def with_peft(*args, **kwargs):
        job = resolve(*args, **kwargs)
        job.model = peft.get_peft_model(
            job.model,
            peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=targets),
        )
        return job

    monkeypatch.setattr(loop, "resolve", with_peft)
    opts.lora = None
    loop.trace_training(opts, str(tmp_path / "peft.jsonl"))
    assert sizes(tmp_path / "ours.jsonl") == sizes(tmp_path / "peft.jsonl")


@pytest.mark.parametrize("double_quant", [True, False])
def test_4bit_layers_hold_what_bitsandbytes_holds(double_quant):
    """QLoRA's base layers hold, byte for byte, what bitsandbytes' quantize_4bit makes of the
    weight (its CPU kernel): the packed weight and every tensor of its QuantState."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    import torch

    from gpumem_trace.lora import Linear4bit

    for shape in [(300, 200), (4096, 11008), (7, 9)]:
        packed, state = bnb_f.quantize_4bit(
            torch.zeros(shape, dtype=torch.bfloat16),
            quant_type="nf4",
            compress_statistics=double_quant,
        )
        theirs = [packed, state.absmax, state.code] + (
            [state.offset, state.state2.absmax, state.state2.code] if double_quant else []
        )
        ours = Linear4bit(
            torch.nn.Linear(shape[1], shape[0], bias=False, device="meta"), double_quant
        )
        assert sorted(t.numel() * t.element_size() for t in theirs) == sorted(
            b.numel() for b in ours.buffers()
        ), shape


@pytest.mark.parametrize("outputs", ["dropped", "kept"])
def test_fabric_qlora_on_bitsandbytes_before_0_43_2_keeps_each_layers_input(tmp_path, outputs):
    """litgpt's QLoRA as its 2024 releases ran it: Fabric's quantizer makes the output head 4-bit
    too (dequantized to fp16, then cast), and bitsandbytes 0.42's matmul keeps the input of every
    4-bit layer whose input needs a gradient until the step's graph dies — after backward where
    the loop drops its outputs (Hugging Face's), only once the next forward has returned where
    it keeps them (litgpt's `logits`)."""
    from gpumem_trace import loop
    from gpumem_trace.lora import Lora

    ref = "hf:LlamaForCausalLM(hidden_size=256,intermediate_size=688,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=1000)"

    def trace(**quant):
        opts = loop.TraceOptions(
            model=ref,
            batch=2,
            seq_len=32,
            precision="bf16",
            outputs=outputs,
            lora=Lora(8, 16.0, ("q_proj", "v_proj"), 0.05, "nf4", False, **quant),
        )
        path = tmp_path / "trace.jsonl"
        loop.trace_training(opts, str(path))
        return live_and_peak([json.loads(line) for line in path.read_text().splitlines()[1:]])

    hf_end, hf_peak = trace()
    fabric_end, fabric_peak = trace(loader="fabric")
    old_end, old_peak = trace(loader="fabric", bitsandbytes=(0, 42, 0))
    # The head (1000 x 256) in 4 bits: packed, an fp32 absmax per 64 weights, the fp32 code.
    head = 1000 * 256
    assert hf_end - fabric_end == 2 * head - (head // 2 + head // 64 * 4 + 16 * 4)
    # Kept per step (bf16, 64 tokens), beyond what autograd saves anyway: layer 0's gate/up
    # (one input) and down_proj inputs (its q/k/v input comes from the frozen embedding: no
    # gradient), layer 1's q/k/v input too, and the head's; o_proj's input is a view of the
    # attention's output, which SDPA saves itself.
    tokens = 2 * 32
    kept = 2 * tokens * ((256 + 688) + (256 + 256 + 688) + 256)
    if outputs == "dropped":
        assert old_peak - fabric_peak == kept
        assert old_end == fabric_end
    else:
        # Two steps' worth at the next forward's end, and more: once backward has released
        # SDPA's saved output, the o_proj input (a view of it) still keeps it whole.
        assert 2 * kept < old_peak - fabric_peak < 3 * kept
        # At the end the last step's graph is still held.
        assert kept < old_end - fabric_end < 2 * kept


def test_qlora_loads_the_model_in_4_bits(tmp_path):
    """--lora-quant nf4: every linear layer but the output head holds 4 bits per weight (and its
    block statistics) instead of bf16's 16; LoRA trains the same factors on top."""
    ref = "hf:LlamaForCausalLM(hidden_size=256,intermediate_size=688,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=1000)"

    def end(*extra):
        header, evs = traced(
            [
                ref,
                "--batch",
                "2",
                "--seq-len",
                "32",
                "--precision",
                "bf16",
                "--lora-rank",
                "8",
                "--lora-targets",
                "q_proj,v_proj",
                *extra,
            ],
            tmp_path,
        )
        return header["parameters"], live_and_peak(evs)[0]

    (lora_params, lora), (qlora_params, qlora) = (
        end(),
        end("--lora-quant", "nf4", "--lora-single-quant"),
    )
    assert lora_params == qlora_params == 2 * 2 * 8 * (256 + 256)
    layers = [(256, 256)] * 4 + [(688, 256)] * 3  # q, k, v, o; gate, up, down
    n = 2 * sum(a * b for a, b in layers)
    # Packed weight, an fp32 absmax per 64-element block, the 16-entry fp32 code.
    four_bit = 2 * sum(a * b // 2 + -(-a * b // 64) * 4 + 16 * 4 for a, b in layers)
    assert lora - qlora == 2 * n - four_bit


@pytest.mark.parametrize(
    "name,cls",
    [("adamw8bit", "AdamW8bit"), ("adam8bit", "Adam8bit"), ("paged-adamw8bit", "PagedAdamW8bit")],
)
def test_8bit_optimizers_hold_what_bitsandbytes_holds(name, cls):
    """The tracer's 8-bit optimizers make the state bitsandbytes' own init_state makes (which
    runs on meta tensors without a GPU): the same tensors, dtypes and shapes, per parameter."""
    bnb = pytest.importorskip("bitsandbytes")
    import torch

    from gpumem_trace.loop import make_optimizer

    # A paged optimizer's state of 100,000 elements and more is CUDA managed memory, which
    # bitsandbytes cannot make without a GPU (test_optimizers.py holds the tracer's paged states,
    # host-backed, to bitsandbytes' own init_state).
    sizes = [(64,), (4095,), (4096,), (300, 70)] + (
        [] if name.startswith("paged") else [(200_000,)]
    )

    def fresh():
        return [torch.nn.Parameter(torch.empty(s, device="meta")) for s in sizes]

    theirs_params, ours_params = fresh(), fresh()
    theirs = getattr(bnb.optim, cls)(theirs_params)
    for gi, g in enumerate(theirs.param_groups):
        for pi, p in enumerate(g["params"]):
            theirs.init_state(g, p, gi, pi)
    ours = make_optimizer(name, ours_params, 1e-3)
    for p in ours_params:
        p.grad = torch.empty_like(p)
    ours.step()

    def layout(state):
        return {
            k: (v.dtype, tuple(v.shape)) for k, v in state.items() if isinstance(v, torch.Tensor)
        }

    assert [layout(theirs.state[p]) for p in theirs_params] == [
        layout(ours.state[p]) for p in ours_params
    ]


def test_8bit_adamw_traces_a_quarter_of_adams_state(tmp_path):
    ref = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)"
    state = {}
    for opt in ("adamw", "adamw8bit"):
        header, evs = traced([ref, "--batch", "2", "--seq-len", "32", "--optimizer", opt], tmp_path)
        state[opt] = sum(e["bytes"] for e in allocs(evs, category="optimizer_state"))
    assert 0.2 < state["adamw8bit"] / state["adamw"] < 0.3, state


def test_ddp_rank_holds_its_gradient_buckets(tmp_path):
    """One rank of DistributedDataParallel, traced with PyTorch's own wrapper on a fake process
    group: at the end of the step it holds what a single GPU holds plus the reducer's gradient
    buckets (one byte per gradient byte); with gradient_as_bucket_view the gradients are the
    buckets, so it holds what a single GPU holds. The world size does not change a rank's
    tensors."""
    ref = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)"

    def live_at_end(*extra):
        header, evs = traced([ref, "--batch", "2", "--seq-len", "32", *extra], tmp_path)
        return header, live_and_peak(evs)[0]

    header, single = live_at_end()
    params = header["parameters"] * 4
    ddp_header, ddp = live_at_end("--strategy", "ddp", "--world-size", "4")
    strategy = ddp_header["options"]["strategy"]
    assert (strategy["kind"], strategy["mesh"]) == ("ddp", {"replicate": 4})
    assert ddp - single == params
    assert live_at_end("--strategy", "ddp", "--world-size", "8")[1] == ddp
    assert (
        live_at_end("--strategy", "ddp", "--world-size", "4", "--gradient-as-bucket-view")[1]
        == single
    )


def test_tensor_parallel_rank_holds_its_share(tmp_path):
    """One rank of tensor parallelism (PyTorch's parallelize_module on the model's own plan, as
    torchtitan lays it out, on a fake process group): at the end of a step it holds 1/N of each
    sharded weight (every linear layer, the embedding, the head) and of Adam's two states on
    them, plus the norms whole on every rank; the same of the gradients but the embedding's,
    which PyTorch's DTensor leaves whole (embedding_dense_backward has no row-wise strategy, so
    the gradient of the vocabulary-sharded table is replicated). Composed with FSDP2 on a 2-D
    mesh (and HSDP on a 3-D one) FSDP shards each rank's share again, the norms and that
    gradient included. Sequence parallelism keeps the residual stream 1/N: the peak falls."""
    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
        return  # FSDP2 and the DTensor plans as the tracer uses them
    layers, hidden, inter, vocab = 2, 64, 128, 1000
    ref = (
        f"hf:LlamaForCausalLM(hidden_size={hidden},intermediate_size={inter},"
        f"num_hidden_layers={layers},num_attention_heads=8,num_key_value_heads=4,vocab_size={vocab})"
    )
    norms = hidden * (2 * layers + 1)
    embedding = vocab * hidden

    def held(*extra):
        header, evs = traced([ref, "--batch", "2", "--seq-len", "32", *extra], tmp_path)
        sizes, live = {}, {}
        for e in evs:
            if e["ev"] == "alloc":
                sizes[e["id"]] = (e["bytes"], e["category"])
            elif e["ev"] == "free":
                del sizes[e["id"]]
        for nbytes, category in sizes.values():
            live[category] = live.get(category, 0) + nbytes
        return header, live, live_and_peak(evs)[1]

    header, single, single_peak = held()
    sharded = header["parameters"] - norms
    buffers = single["parameter"] - 4 * header["parameters"]  # the rotary table
    for n in (2, 4):
        h, rank, peak = held("--tp", str(n))
        assert h["options"]["strategy"]["mesh"] == {"shard": 1, "tensor": n}
        share = sharded // n + norms
        assert rank["parameter"] == 4 * share + buffers, (n, rank)
        assert rank["optimizer_state"] == 8 * share, (n, rank)
        assert rank["gradient"] == 4 * (share + embedding - embedding // n), (n, rank)
        assert peak < single_peak
    for extra in (("--world-size", "4"), ("--world-size", "8", "--replicas", "2")):
        h, rank, _ = held("--strategy", "fsdp", *extra, "--tp", "2")
        mesh = h["options"]["strategy"]["mesh"]
        assert (mesh["shard"], mesh["tensor"], mesh.get("replicate", 1)) == (
            2,
            2,
            int(extra[-1]) if len(extra) > 2 else 1,
        )
        share = sharded // 4 + norms // 2
        assert (rank["parameter"], rank["optimizer_state"], rank["gradient"]) == (
            4 * share,
            8 * share,
            4 * share,
        ), rank
        # The rank's collectives ran on FSDP's group, the tensor-parallel one and, with HSDP,
        # the replicas': each an NCCL communicator on a GPU.
        sizes = sorted(c["ranks"] for c in h["communicators"])
        assert sizes == ([2, 2, 2] if len(extra) > 2 else [2, 2]), h["communicators"]
    h, _, _ = held("--strategy", "ddp", "--world-size", "4")
    assert [c["ranks"] for c in h["communicators"]] == [4], h["communicators"]
    assert "communicators" not in held()[0]
    for bad, needle in (
        (["--tp", "3"], "num_attention_heads=8 does not divide over 3 tensor-parallel ranks"),
        (["--strategy", "ddp", "--world-size", "4", "--tp", "2"], "compose with fsdp"),
    ):
        p, _ = run([ref, "--batch", "2", *bad], tmp_path)
        assert p.returncode == 2 and needle in p.stderr, p.stderr
    p, _ = run(["hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2)", "--tp", "2"], tmp_path)
    assert p.returncode == 2 and "needs the model's tensor-parallel plan" in p.stderr, p.stderr


def test_pipeline_stage_holds_its_layers_and_its_schedules_micro_batches(tmp_path):
    """One rank of pipeline parallelism (pipeline.py): stage k holds exactly its layers (the
    embedding with the first, the final norm and head with the last; with virtual stages the
    looped chunks k, k + stages), and what it keeps for backward is its schedule's in-flight
    micro-batches: GPipe all M, 1F1B min(M, stages - k) — beside PyTorch's receive buffers, one
    per micro-batch, kept from the first step; zero bubble keeps more. Composed with FSDP2, a
    stage's share is sharded again."""
    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
        return  # FSDP2 and PyTorch's pipelining schedules as the tracer uses them
    hidden, inter, vocab, heads, kv = 64, 128, 1000, 8, 4
    ref = (
        f"hf:LlamaForCausalLM(hidden_size={hidden},intermediate_size={inter},num_hidden_layers=4,"
        f"num_attention_heads={heads},num_key_value_heads={kv},vocab_size={vocab})"
    )
    head_dim = hidden // heads
    layer = 2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    embedding = head = vocab * hidden
    seq, micro = 32, 2

    def run_stage(stage, schedule, m, *extra, peak_of=("activation",)):
        args = [ref, "--batch", str(micro * m), "--seq-len", str(seq), "--pp", "2"]
        args += ["--pp-rank", str(stage), "--schedule", schedule, "--microbatches", str(m)]
        header, evs = traced([*args, *extra], tmp_path)
        sizes, live, acts, peak = {}, {}, 0, 0
        for e in evs:
            if e["ev"] == "alloc":
                sizes[e["id"]] = (e["bytes"], e["category"])
                if e["category"] in peak_of:
                    acts += e["bytes"]
                    peak = max(peak, acts)
            elif e["ev"] == "free":
                nbytes, category = sizes.pop(e["id"])
                if category in peak_of:
                    acts -= nbytes
        for nbytes, category in sizes.values():
            live[category] = live.get(category, 0) + nbytes
        return header, live, peak

    buffer = micro * seq * hidden * 4  # one micro-batch's activations (or their gradients)
    rotary = 2 * 4 * (head_dim // 2)  # the rotary tables inv_freq and original_inv_freq
    share = {0: embedding + 2 * layer, 1: 2 * layer + hidden + head}
    for stage in (0, 1):
        runs = [run_stage(stage, "1f1b", m) for m in (1, 2, 4)]
        h, live, _ = runs[1]
        assert h["options"]["strategy"]["mesh"] == {"shard": 1, "pipeline": 2}
        assert live["parameter"] == 4 * share[stage] + rotary, (stage, live)
        assert live["optimizer_state"] == 8 * share[stage], (stage, live)
        assert live["activation"] == 2 * buffer  # M receive buffers, kept
        one_f_one_b = [peak for _, _, peak in runs]
        # One micro-batch runs the same under both schedules.
        gpipe = [one_f_one_b[0]] + [run_stage(stage, "gpipe", m)[2] for m in (2, 4)]
        assert gpipe[2] - gpipe[1] == 2 * (gpipe[1] - gpipe[0]) > 2 * buffer, (stage, gpipe)
        # In flight: min(M, 2 - stage); beyond that only the receive buffers grow.
        if stage == 0:
            assert one_f_one_b[1] - one_f_one_b[0] == gpipe[1] - gpipe[0]
        assert one_f_one_b[2] - one_f_one_b[1] == 2 * buffer, (stage, one_f_one_b)
        assert one_f_one_b[2] < gpipe[2]
        # Zero bubble: the same gradients, each weights' half of a backward run later than its
        # input's, which keeps what the weights' gradients need in between (PyTorch's
        # stage_backward_input/weight) — more than 1F1B's, at the last stage.
        _, zb_live, zb_peak = run_stage(stage, "zero-bubble", 4)
        assert zb_live["gradient"] == runs[2][1]["gradient"] == 4 * share[stage]
        assert zb_peak >= one_f_one_b[2] if stage == 0 else zb_peak > one_f_one_b[2]
    # Interleaved: rank 0 holds chunks 0 and 2 of 4 (one layer each), the embedding with the
    # first; each non-first chunk receives activations, each non-last chunk their gradients.
    _, live, _ = run_stage(0, "interleaved-1f1b", 4, "--virtual-stages", "2")
    assert live["parameter"] == 4 * (embedding + 2 * layer) + rotary
    assert live["activation"] == 3 * 4 * buffer
    # FSDP2 over 2 ranks of each stage: the stage's share halved (every size divides).
    _, live, _ = run_stage(1, "1f1b", 2, "--strategy", "fsdp", "--world-size", "4")
    assert live["optimizer_state"] == 8 * share[1] // 2, live
    # PyTorch's stage reduces the gradients once, after the last micro-batch: until then the
    # stage's are whole (unsharded), accumulated in fp32 under a bf16 policy.
    fsdp = ("--strategy", "fsdp", "--world-size", "4", "--fsdp-param-dtype", "bf16")
    _, _, held = run_stage(1, "1f1b", 2, *fsdp, peak_of=("gradient",))
    assert held >= 4 * share[1], (held, share[1])
    # Interleaved with as many micro-batches as stages, each chunk's backwards run together,
    # and PyTorch's schedule reduces a chunk's gradients right after its last one (PyTorch
    # 2.10 on: `_add_reduce_grad`; before, inside that backward): rank 0's later chunk is
    # sharded again before its first chunk accumulates, so it never holds both whole.
    from torch.distributed.pipelining.stage import _PipelineStageBase

    if hasattr(_PipelineStageBase, "perform_reduce_grad"):
        vs = ("--virtual-stages", "2")
        _, _, held = run_stage(0, "interleaved-1f1b", 2, *vs, *fsdp, peak_of=("gradient",))
        assert held < 4 * (embedding + 2 * layer), held
    for bad, needle in (
        (["--pp", "8", "--schedule", "1f1b"], "4 layers do not fill 8 pipeline stages"),
        (["--pp", "2", "--microbatches", "3"], "does not split into 3 equal micro-batches"),
    ):
        p, _ = run([ref, "--batch", "4", *bad], tmp_path)
        assert p.returncode == 2 and needle in p.stderr, p.stderr


def test_float8_linears_run_torchaos_own_casts_and_matmuls(tmp_path):
    """--float8: torchao's own Float8Linear in place of each linear layer but the head, as
    torchtitan's converter swaps it in, traced through its float8 tensors: every matmul of a
    converted layer (forward, input and weight gradients) is ``_scaled_mm`` on 1-byte casts,
    the head's stay ``mm``; torchao keeps the layer's 16-bit input for backward, so forward
    ends holding what bf16 holds; under FSDP2 with float8 all-gathers each converted weight is
    gathered in one byte instead of two (the embedding, norms and head still in bf16)."""
    import torch  # noqa: F401

    pytest.importorskip("torchao.float8")
    ref = (
        "hf:LlamaForCausalLM(hidden_size=256,intermediate_size=1024,num_hidden_layers=2,"
        "num_attention_heads=4,num_key_value_heads=4,vocab_size=4096)"
    )
    linear_params = 2 * (4 * 256 * 256 + 3 * 256 * 1024)  # q, k, v, o, gate, up, down

    def second_step(*extra):
        _, evs = traced([ref, "--batch", "2", "--seq-len", "64", *extra], tmp_path)
        live, iteration, kept, gathered, kernels = {}, 0, None, 0, {}
        for e in evs:
            iteration += e["ev"] == "iteration"
            if iteration != 1:
                continue
            if e["ev"] == "alloc":
                live[e["id"]] = e
                if e["phase"] == "forward" and e["op"] == "fsdp_all_gather":
                    gathered += e["bytes"]
                if e["phase"] == "backward" and kept is None:
                    kept = sum(a["bytes"] for a in live.values() if a["category"] == "activation")
            elif e["ev"] == "free":
                live.pop(e["id"], None)
            elif e["ev"] == "op":
                kernels[e["op"]] = kernels.get(e["op"], 0) + 1
        return kept, gathered, kernels.get("_scaled_mm", 0), kernels.get("mm", 0)

    bf16 = second_step("--precision", "bf16")
    f8 = second_step("--precision", "bf16", "--float8", "tensorwise")
    assert (bf16[2], bf16[3]) == (0, 45) and (f8[2], f8[3]) == (42, 3), (bf16, f8)
    assert f8[0] == bf16[0], (bf16, f8)
    fsdp = ("--strategy", "fsdp", "--world-size", "4", "--fsdp-param-dtype", "bf16")
    _, bf16_gathered, _, _ = second_step(*fsdp)
    _, f8_gathered, scaled, _ = second_step(*fsdp, "--float8", "tensorwise", "--float8-all-gather")
    assert scaled == 42 and bf16_gathered - f8_gathered == linear_params, (
        bf16_gathered,
        f8_gathered,
    )
    # A pipeline stage (torchtitan converts before it splits the model): its one layer's
    # matmuls in float8 for each of its two micro-batches, its weights gathered in one byte —
    # twice on the first stage (1F1B: both forwards before a backward), once on the last (a
    # stage keeps its weights gathered from one micro-batch's backward to the next forward).
    pp = ("--pp", "2", "--microbatches", "2")
    for rank, gathers in (("0", 2), ("1", 1)):
        _, bf16_gathered, _, _ = second_step(*fsdp, *pp, "--pp-rank", rank)
        _, f8_gathered, scaled, _ = second_step(
            *fsdp, *pp, "--pp-rank", rank, "--float8", "tensorwise", "--float8-all-gather"
        )
        assert scaled == 42 and bf16_gathered - f8_gathered == gathers * linear_params // 2, (
            rank,
            scaled,
            bf16_gathered,
            f8_gathered,
        )
    for bad, needle in (
        (["--float8", "rowwise", "--float8-all-gather", *fsdp], "the tensorwise recipe"),
        (["--float8", "tensorwise", "--float8-all-gather"], "--strategy fsdp"),
    ):
        p, _ = run([ref, *bad], tmp_path)
        assert p.returncode == 2 and needle in p.stderr, p.stderr


def test_fsdp_accumulation_under_no_sync_holds_the_whole_gradient(tmp_path):
    """FSDP2 under gradient accumulation, PyTorch's own code: with the trainers' ``no_sync``
    (accelerate's, Hugging Face's Trainer's, Fabric's: ``set_requires_gradient_sync(False)``
    until the last micro-batch) a rank holds the whole model's gradients unsharded — in fp32,
    FSDP's accumulators, under a bf16 policy too — reduce-scattered only by the last backward;
    reducing each micro-batch's (``--sync-each-batch``: torchtitan's, torchtune's) it never
    holds more than a quarter of them and a layer's."""
    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
        return  # FSDP2 (test_fsdp_rank_holds_its_shards checks the refusal)
    ref = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)"
    fsdp = [ref, "--batch", "2", "--seq-len", "32", "--strategy", "fsdp", "--world-size", "4"]

    def gradients_and_peak(*extra):
        header, evs = traced([*fsdp, *extra], tmp_path)
        sizes, held, peak = {}, 0, 0
        category = {}  # as the trace ends (a relabel rewrites the allocation's)
        for e in evs:
            if e["ev"] == "alloc":
                sizes[e["id"]] = e["bytes"]
                category[e["id"]] = e["category"]
            elif e["ev"] == "free":
                sizes.pop(e["id"])
            held = max(held, sum(b for i, b in sizes.items() if category[i] == "gradient"))
            peak = max(peak, sum(sizes.values()))
        return header["parameters"], held, peak

    whole = None
    for policy in ((), ("--fsdp-param-dtype", "bf16")):
        params, held, peak = gradients_and_peak("--grad-accum", "2", *policy)
        whole = 4 * params
        assert held >= whole, (policy, held, whole)
        assert gradients_and_peak("--grad-accum", "3", *policy)[1:] == (held, peak)
        _, synced, synced_peak = gradients_and_peak(
            "--grad-accum", "2", "--sync-each-batch", *policy
        )
        assert synced < whole // 2 and synced_peak < peak, (policy, synced, synced_peak, peak)
    # One micro-batch: nothing to defer, the same trace either way.
    assert gradients_and_peak() == gradients_and_peak("--sync-each-batch")
    p, _ = run([ref, "--strategy", "ddp", "--world-size", "2", "--sync-each-batch"], tmp_path)
    assert p.returncode == 2 and "--sync-each-batch is FSDP's" in p.stderr, p.stderr


def test_fsdp_rank_holds_its_shards(tmp_path):
    """One rank of FSDP2 (fully_shard per block, then the model), PyTorch's own code on a fake
    process group: at the end of a step it holds a single GPU's bytes less (N-1)/N of the
    parameters, gradients and Adam's two states (every dimension here divides by N: no
    padding), the gathered layers all freed; keeping them from forward to backward
    (reshard_after_forward=False) raises the peak; a bf16 mixed-precision policy lowers it."""
    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
        p, _ = run(
            [
                "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)",
                "--batch",
                "2",
                "--strategy",
                "fsdp",
                "--world-size",
                "2",
            ],
            tmp_path,
        )
        assert p.returncode == 2 and "tracing FSDP2 needs torch 2.6 or newer" in p.stderr
        return
    ref = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)"

    def run_fsdp(*extra):
        header, evs = traced([ref, "--batch", "2", "--seq-len", "32", *extra], tmp_path)
        return header, live_and_peak(evs)

    header, (single, _) = run_fsdp()
    states = header["parameters"] * 4 * 4  # fp32 parameters, gradients, exp_avg, exp_avg_sq
    # FSDP2's own streams, as its code chooses them: each gather's buffers come from the
    # all-gather copy-in stream's pool (forward and backward), each reduce-scatter's output
    # from the reduce-scatter stream's (backward's gradients); nothing else leaves stream 0.
    _, evs = traced([ref, "--batch", "2", "--strategy", "fsdp", "--world-size", "4"], tmp_path)
    streams = {}
    for e in evs:
        if e["ev"] == "alloc" and e.get("stream", 0):
            streams.setdefault(e["stream"], set()).add((e["phase"], e["category"]))
    assert sorted(streams.values(), key=len) == [
        {("backward", "gradient")},
        {("forward", "activation"), ("backward", "temporary")},
    ], streams
    for n in (2, 4):
        h, (end, peak) = run_fsdp("--strategy", "fsdp", "--world-size", str(n))
        assert strategy_of(h) == ("fsdp", n)
        assert end == single - states * (n - 1) // n, (n, end, single, states)
    _, (_, kept) = run_fsdp("--strategy", "fsdp", "--world-size", "4", "--no-reshard-after-forward")
    assert kept > peak
    # MixedPrecisionPolicy(param_dtype=bf16): layers gathered and computed in bf16, gradients
    # reduced into the same fp32 shards, so the step ends where fp32 ends, from a lower peak.
    _, (mp_end, mp_peak) = run_fsdp(
        "--strategy", "fsdp", "--world-size", "4", "--fsdp-param-dtype", "bf16"
    )
    assert mp_end == end and mp_peak < peak
    # HSDP over 2 machines of 4: sharded as FSDP over 4 (the cross-machine all-reduce is in place).
    assert run_fsdp("--strategy", "fsdp", "--world-size", "8", "--replicas", "2")[1] == (end, peak)
    p, _ = run([ref, "--strategy", "fsdp", "--world-size", "8", "--replicas", "3"], tmp_path)
    assert p.returncode == 2 and "--replicas 3 must divide --world-size 8" in p.stderr
    # CPUOffloadPolicy: shards, gradients and Adam's state all on the host, so the step ends a
    # single GPU's bytes less all of them; nothing is allocated on the GPU at setup or in the
    # optimizer's step (the host's); each gather copies every shard to the GPU first (three
    # steps, gathered again for backward: every dimension divides by 4, so no padding).
    h, evs = traced(
        [
            ref,
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--strategy",
            "fsdp",
            "--world-size",
            "4",
            "--cpu-offload",
        ],
        tmp_path,
    )
    off_end, off_peak = live_and_peak(evs)
    assert off_end == single - states and off_peak < peak, (
        off_end,
        single - states,
        off_peak,
        peak,
    )
    allocs = [e for e in evs if e["ev"] == "alloc"]
    assert not [e for e in allocs if e["phase"] in ("setup", "optimizer")]
    staged = sum(e["bytes"] for e in allocs if e["phase"] == "backward" and e["op"] == "clone")
    assert staged == 3 * h["parameters"] * 4 // 4, staged


def test_zero_ranks_hold_deepspeeds_partitions(tmp_path):
    """DeepSpeed ZeRO modelled from its config (DeepSpeed is not needed): after a bf16 step a
    rank holds, in place of a single GPU's 16-bit parameters, gradients and Adam state (8 bytes
    per parameter), stages 1-2: the 16-bit parameters (2), and its partition's fp32 master
    weights and two moments (12 / N); stage 3: 16-bit partitions of the parameters and the
    reduced gradients besides (16 / N), the gradient bucket, and the parameters small enough
    to persist gathered. Offloading the optimizer leaves stage 2 the parameters and a staging
    buffer of the largest parameter. (Every size here divides by 2 x N: no padding.)"""
    ref = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)"

    def end(*extra):
        header, evs = traced(
            [ref, "--batch", "1", "--seq-len", "8", "--precision", "bf16", *extra], tmp_path
        )
        return header, live_and_peak(evs)[0]

    header, single = end()
    p, n, bucket, embedding = header["parameters"], 4, 100_000, 8000 * 64
    zero = lambda stage, **cfg: end(
        "--strategy",
        f"zero{stage}",
        "--world-size",
        str(n),
        "--zero",
        json.dumps(dict(reduce_bucket_size=bucket, **cfg)),
    )
    for stage in (1, 2):
        h, live = zero(stage)
        assert (*strategy_of(h), h["largest_layer_parameters"]) == (
            f"zero{stage}",
            n,
            embedding,
        )
        assert live == single - 8 * p + 2 * p + 12 * p // n, stage
    persistent = p - embedding  # every parameter but the embedding is under 100,000 elements
    assert zero(3)[1] == single - 8 * p + 16 * p // n + 2 * bucket + 2 * persistent
    assert zero(3, param_persistence_threshold=0)[1] == single - 8 * p + 16 * p // n + 2 * bucket
    assert zero(2, offload_optimizer=True)[1] == single - 8 * p + 2 * p + 2 * embedding


def test_zero_options_are_checked(tmp_path):
    ref = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)"
    p, _ = run(
        [ref, "--strategy", "zero2", "--world-size", "2", "--zero", '{"bucket": 1}'], tmp_path
    )
    assert p.returncode == 2 and "the request's options: " in p.stderr and "bucket" in p.stderr
    p, _ = run(
        [ref, "--strategy", "zero2", "--world-size", "2", "--optimizer", "adam8bit"], tmp_path
    )
    assert p.returncode == 2 and "ZeRO runs its own optimizer partitions" in p.stderr


def test_a_lora_model_is_still_sharded_and_checkpointed_by_its_layers():
    """LoRA wraps each target layer; the repeated block FSDP shards and checkpointing wraps is
    still the model's own layer (a LoRA layer is not a block)."""
    pytest.importorskip("transformers")
    from gpumem_trace.loop import repeated_blocks
    from gpumem_trace.lora import Lora, apply
    from gpumem_trace.models import resolve

    model = resolve(LLAMA_16K, seq_len=32).model
    apply(model, Lora(8, 16.0, ("q_proj", "v_proj")), LLAMA_16K)
    assert {type(b).__name__ for b in repeated_blocks(model, LLAMA_16K, "FSDP")} == {
        "LlamaDecoderLayer"
    }


def test_record_runs_lora_and_checkpointing(tmp_path):
    """gpumem_trace.record (the GPU measurement of a job) runs a LoRA fine-tune with
    checkpointing in pure bf16 as the tracer's loop does; on the host it checks the loop (only
    CUDA has a snapshot)."""
    import argparse

    from gpumem_trace import record

    ref = "hf:LlamaForCausalLM(hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=1000)"
    a = argparse.Namespace(
        model=ref,
        batch=2,
        seq_len=16,
        input_shape=None,
        optimizer="adamw",
        precision="bf16",
        iterations=2,
        benchmark=False,
        stacks=False,
        max_entries=1,
        channels_last=False,
        outputs=None,
        checkpointing=True,
        selective=False,
        lora_rank=4,
        lora_alpha=8.0,
        lora_targets="q_proj,v_proj",
        lora_dropout=0.0,
        out=str(tmp_path / "snap.pickle"),
    )
    assert record.record(a, device="cpu") is None
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem_trace.record",
            ref,
            "--batch",
            "2",
            "--lora-rank",
            "0",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(PKG)),
    )
    assert p.returncode == 2 and "--lora-rank must be at least 1" in p.stderr


def test_a_deep_stack_is_cut_only_where_its_blocks_repeat():
    """--depths cuts the one stack of identical blocks (a transformer's layers) when it is deep
    enough to save time; a model whose blocks differ (ResNet's stages) or that is shallow stays
    whole. What the cut trace says is checked against the whole model's in the bridge's
    tests (gpumem rebuilds it event for event)."""
    torchvision = pytest.importorskip("torchvision")
    from gpumem_trace.loop import cut_blocks
    from gpumem_trace.models import resolve

    deep = resolve(
        "hf:LlamaForCausalLM(hidden_size=64,intermediate_size=128,num_hidden_layers=16,num_attention_heads=4,num_key_value_heads=2,vocab_size=256)",
        seq_len=16,
    ).model
    params = sum(p.numel() for p in deep.parameters())
    assert cut_blocks(deep, "llama", 3) == 16
    assert len(deep.model.layers) == 3 and sum(p.numel() for p in deep.parameters()) < params
    shallow = resolve(LLAMA_16K, seq_len=16).model
    assert cut_blocks(shallow, "llama", 3) is None
    resnet = torchvision.models.resnet18()
    assert cut_blocks(resnet, "resnet18", 2) is None


def test_depths_write_cut_traces_that_say_so(tmp_path):
    ref = "hf:GPT2LMHeadModel(n_embd=32,n_layer=16,n_head=2,vocab_size=512)"
    out, env = tmp_path / "t.jsonl", dict(os.environ, PYTHONPATH=str(PKG))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem_trace",
            ref,
            "--batch",
            "2",
            "--seq-len",
            "16",
            "--out",
            str(out),
            "--depths",
            "2",
            "3",
            "4",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert not out.exists()
    headers = [json.loads(open(f"{out}.depth{d}").readline()) for d in (2, 3, 4)]
    assert [(h["blocks"], h["depth"]) for h in headers] == [(16, 2), (16, 3), (16, 4)]
    assert len({h["parameters"] for h in headers}) == 1  # the whole model's
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem_trace",
            ref,
            "--batch",
            "2",
            "--seq-len",
            "16",
            "--out",
            str(out),
            "--depths",
            "2",
            "3",
            "4",
            "--strategy",
            "ddp",
            "--world-size",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert (
        p.returncode == 0 and out.exists() and "depth" not in json.loads(out.open().readline())
    )  # DDP: whole


def test_an_iteration_is_copied_only_where_the_loop_is_steady():
    """The recorder's copy of the last iteration frees the tensors that outlive it where the
    last one freed their counterparts of the iteration before; it refuses where the last
    iteration frees what the setup made, or what outlives it does not match what it freed."""
    from gpumem_trace.tracer import Recorder

    def loop(rec, iterations, rebuild=False):
        bucket = rec.alloc("bucket", 64, "empty")  # the setup's
        state = batch = None
        for it in range(iterations):
            rec.phase = "forward"
            if batch is not None:
                rec.free(batch)
            batch = f"batch{it}"
            rec.alloc(batch, 32, "empty")
            rec.transient(16, "mm")
            if rebuild and it == 1:
                rec.free("bucket")  # DDP rebuilds its buckets in the second iteration
                rec.alloc("bucket2", 64, "empty")
            rec.phase = "optimizer"
            if state is None:
                state = rec.alloc("state", 128, "empty")
            rec.iteration_end()
        return bucket

    run, copied = Recorder(), Recorder()
    loop(run, 4)
    loop(copied, 2)
    assert copied.repeat_last_iteration() and copied.repeat_last_iteration()
    assert copied.events == run.events and copied.iterations == 4
    ddp = Recorder()
    loop(ddp, 2, rebuild=True)
    n = len(ddp.events)
    assert not ddp.repeat_last_iteration() and len(ddp.events) == n
    grown = Recorder()
    loop(grown, 2)
    grown.events.insert(
        -1,
        {
            "ev": "alloc",
            "id": 99,
            "bytes": 8,
            "category": "activation",
            "phase": "forward",
            "op": "cat",
        },
    )
    assert not grown.repeat_last_iteration()  # a tensor each iteration keeps: not steady


@pytest.mark.parametrize(
    "options",
    [
        ["--precision", "amp-bf16", "--checkpointing"],
        ["--strategy", "zero3", "--world-size", "4", "--precision", "bf16"],
    ],
)
def test_a_copied_iteration_is_the_one_the_loop_runs(tmp_path, options):
    """The third iteration copied from the second (the default) is the trace of running it,
    event for event — with checkpointing, whose recomputation stops early inside a module."""
    pytest.importorskip("transformers")
    args = [LLAMA_16K, "--batch", "2", "--seq-len", "16", *options]
    _, copied = traced(args, tmp_path)
    _, ran = traced([*args, "--every-iteration"], tmp_path)
    assert copied == ran


@pytest.mark.parametrize(
    "args",
    [
        [LLAMA_16K, "--seq-len", "16", "--precision", "amp-bf16", "--checkpointing"],
        [
            "torchvision:resnet18",
            "--input",
            "3x32x32",
            "--precision",
            "amp-fp16",
            "--channels-last",
        ],
    ],
)
def test_remembered_meta_outputs_are_the_kernels_own(tmp_path, monkeypatch, args):
    """A trace whose ops' outputs come from the memo (after each op's first run) is the trace
    of running every meta kernel, event for event."""
    if args[0].startswith("hf:"):
        pytest.importorskip("transformers")
    from gpumem_trace import __main__ as cli
    from gpumem_trace import tracer

    def trace(name):
        out = tmp_path / name
        assert cli.main([*args, "--batch", "2", "--out", str(out)]) == 0
        return out.read_text().splitlines()[1:]

    memo = tracer.MetaMemo()
    monkeypatch.setattr(tracer, "META_MEMO", memo)
    remembered = trace("remembered")
    assert any(e is not None for e in memo.outputs.values())
    monkeypatch.setattr(
        tracer.MetaMemo, "run", lambda self, func, args, kwargs: (NotImplemented, None)
    )
    assert remembered == trace("run")


@pytest.mark.parametrize(
    "options",
    [
        ["--precision", "amp-bf16", "--checkpointing"],
        # torch 2.15's FSDP2 starts autograd's worker threads, after which a fork cannot run backward:
        # the forks are made before any.
        ["--strategy", "fsdp", "--world-size", "2", "--fsdp-param-dtype", "bf16"],
    ],
)
def test_batch_sizes_traced_side_by_side_are_each_traced_alone(tmp_path, options):
    """The batch sizes, traced in forks of the tracer side by side, are what a tracer given each
    alone writes."""
    pytest.importorskip("transformers")
    args = [LLAMA_16K, "--seq-len", "16", *options]
    env = dict(os.environ, PYTHONPATH=str(PKG))
    outs = [tmp_path / f"b{b}.jsonl" for b in (2, 3, 4)]
    tracer = [sys.executable, "-m", "gpumem_trace", *args]
    subprocess.run(
        [*tracer, "--batch", "2", "3", "4", "--out", *map(str, outs)],
        check=True,
        env=env,
        timeout=300,
    )
    subprocess.run(
        [*tracer, "--batch", "4", "--out", str(tmp_path / "alone.jsonl")],
        check=True,
        env=env,
        timeout=300,
    )
    events = lambda p: p.read_text().splitlines()[1:]
    assert events(outs[2]) == events(tmp_path / "alone.jsonl")


def test_the_pool_forks_a_tracer_per_request_and_answers_each(tmp_path):
    """The pool answers each request with its fork's exit code, the fork's messages in its log
    and its answer in the request's result file; a kill ends a fork; the end of its input ends
    the pool."""
    import threading

    from gpumem_trace.__main__ import flags
    from gpumem_trace.request import from_flags

    if sys.platform != "linux":
        pytest.skip("the pool forks (Linux)")
    env = dict(os.environ, PYTHONPATH=str(PKG))
    pool = subprocess.Popen(
        [sys.executable, "-m", "gpumem_trace.pool"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(
        300, pool.kill
    )  # a pool that never answers fails the test, not hangs it
    watchdog.daemon = True
    watchdog.start()
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"

    def request(model, out):
        # gpumem's request, as a person's flags state it (tests/test_request.py holds the two
        # to the schema).
        return from_flags(
            flags().parse_args(
                [model, "--batch", "4", "--out", str(out), "--result", f"{out}.answer"]
            )
        )

    requests = [
        {"id": 1, "request": request(f"py:{FIX}:tiny", good), "log": str(tmp_path / "good.log")},
        {
            "id": 2,
            "request": request("torchvision:no_such_net", bad),
            "log": str(tmp_path / "bad.log"),
        },
        # A fork that never ends, killed (with what it forked) when gpumem asks.
        {
            "id": 3,
            "request": request(f"py:{FIX}:ignores_its_alarm", tmp_path / "hung.jsonl"),
            "log": str(tmp_path / "hung.log"),
        },
    ]
    pool.stdin.write("".join(json.dumps(r) + "\n" for r in requests))
    pool.stdin.flush()
    answers = [json.loads(pool.stdout.readline()) for _ in requests[:2]]
    pool.stdin.write(json.dumps({"kill": 3}) + "\n")
    pool.stdin.flush()
    answers.append(json.loads(pool.stdout.readline()))
    pool.stdin.close()
    assert pool.wait(timeout=60) == 0
    watchdog.cancel()
    pool.stdout.close()
    assert {a["id"]: a["code"] for a in answers} == {1: 0, 2: 2, 3: -9}
    check_valid([json.loads(line) for line in good.read_text().splitlines()])
    assert json.loads((tmp_path / "good.jsonl.answer").read_text())["status"] == "ok"
    assert not bad.exists() and "no_such_net" in (tmp_path / "bad.log").read_text()
    answer = json.loads((tmp_path / "bad.jsonl.answer").read_text())
    assert (answer["status"], answer["kind"]) == ("failed", "reference")
    assert "no_such_net" in answer["message"]


def test_chunked_cross_entropy_never_holds_the_whole_fp32_logits(tmp_path):
    """torchtune's chunked cross-entropy: the output projection per slice, each slice upcast to
    fp32 in turn. The model's own loss makes the whole fp32 logits at once; chunked, no
    allocation is that large, the largest fp32 one is a slice's, and the peak is lower."""
    pytest.importorskip("transformers")
    batch, seq, vocab, chunks = 2, 256, 16000, 8
    whole = batch * seq * vocab * 4

    def trace(*extra):
        return traced(
            [
                LLAMA_16K,
                "--batch",
                str(batch),
                "--seq-len",
                str(seq),
                "--precision",
                "bf16",
                *extra,
            ],
            tmp_path,
        )

    _, plain = trace()
    header, chunked = trace("--chunked-ce", str(chunks))
    assert header["options"]["chunked_ce"] == chunks
    assert max(e["bytes"] for e in allocs(plain)) >= whole
    largest = max(e["bytes"] for e in allocs(chunked))
    assert largest < whole and largest >= whole // chunks
    assert live_and_peak(chunked)[1] < live_and_peak(plain)[1] - whole // 2


def test_a_compiled_cross_entropy_keeps_what_inductor_keeps():
    """``--compile``'s loss, byte for byte: AOTAutograd's min-cut partition keeps the row maxima
    and log-sums for backward (not eager's fp32 log-probabilities), and Inductor's fused kernels
    make no [tokens, vocab] buffer but the gradient, in the logits' dtype."""
    import torch
    import torch.nn.functional as F

    from gpumem_trace.compiled import Compiled
    from gpumem_trace.tracer import ModulePaths, Recorder, TraceMode

    tokens, vocab = 512, 1000

    def cross_entropy(logits, target):
        return F.cross_entropy(logits.float(), target, reduction="sum")

    def trace(loss):
        rec = Recorder()
        rec.phase = "forward"
        with TraceMode(rec, ModulePaths(torch.nn.Identity()), "meta"):
            logits = torch.empty(tokens, vocab, dtype=torch.bfloat16, device="meta")
            logits.requires_grad_(True)
            target = torch.zeros(tokens, dtype=torch.long, device="meta")
            value = loss(logits, target)
            rec.phase = "backward"
            value.backward()
        assert (logits.grad.shape, logits.grad.dtype) == (logits.shape, torch.bfloat16)
        made = [(e["phase"], e["bytes"]) for e in rec.events if e["ev"] == "alloc"][2:]
        return made, live_and_peak(rec.events)[1]

    whole_fp32 = tokens * vocab * 4
    eager, eager_peak = trace(cross_entropy)
    assert ("forward", whole_fp32) in eager  # the upcast and the log-probabilities
    compiled, compiled_peak = trace(Compiled(cross_entropy))
    row = tokens * 4  # one fp32 value per token
    assert compiled == [
        ("forward", row),  # amax
        ("forward", row),  # the sum of exponentials
        ("forward", row),  # its log, kept for backward
        ("forward", 4),  # the loss
        ("backward", 4),  # autograd's seed gradient
        ("backward", row),  # the sum of the one-hot gradient
        ("backward", tokens * vocab * 2),  # the logits' gradient, bf16
    ]
    assert compiled_peak < eager_peak - 2 * whole_fp32


def test_compile_traces_the_loss_the_trainer_compiles(tmp_path):
    """``--compile`` on a Hugging Face language model compiles its ``loss_function``, and with
    ``--chunked-ce`` torchtune's per-slice cross-entropy: neither makes fp32 log-probabilities
    or their gradients (what stays fp32 is the Trainer's own cast of its outputs)."""
    pytest.importorskip("transformers")
    batch, seq, vocab, chunks = 2, 256, 16000, 4

    def trace(*extra):
        return traced(
            [LLAMA_16K, "--batch", str(batch), "--seq-len", str(seq), "--precision", "bf16"]
            + list(extra),
            tmp_path,
        )

    for extra, slices in (((), 1), (("--chunked-ce", str(chunks)), chunks)):
        _, eager = trace(*extra)
        header, compiled = trace(*extra, "--compile")
        assert header["options"]["compile"] is True
        fp32 = batch * seq // slices * vocab * 4
        assert allocs(eager, op="_log_softmax", bytes=fp32)
        eager_only = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_backward")
        assert not [e for e in allocs(compiled) if e["op"] in eager_only]
        assert allocs(compiled, op="amax", bytes=fp32 // vocab)  # a row's maximum
        assert live_and_peak(compiled)[1] < live_and_peak(eager)[1] - fp32
    # In the Trainer's evaluation too (no gradients: the forward graph alone), where library
    # code is shown a GPU and the graphs are still made on the host.
    _, evaluated = trace("--compile", "--whole-run", "--eval-batches", "2")
    assert any(e["ev"] == "run_phase" and e["name"] == "evaluate" for e in evaluated)
    assert not [e for e in allocs(evaluated) if e["op"] in eager_only]


@pytest.mark.parametrize(
    "flags,needs,message",
    [
        (
            ["--chunked-ce", "4"],
            "transformers",
            "--chunked-ce applies to Hugging Face causal language models",
        ),
        (["--liger", "rope=false"], "liger_kernel", "Liger has no kernels for model type `bert`"),
    ],
)
def test_a_loss_of_causal_language_models_needs_one(tmp_path, flags, needs, message):
    """A BERT classifier refuses what replaces a causal language model's loss, in one line."""
    pytest.importorskip(needs)
    p, _ = run(
        [
            "hf:BertForSequenceClassification(hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,vocab_size=100)",
            "--batch",
            "2",
            "--seq-len",
            "16",
            *flags,
        ],
        tmp_path,
    )
    assert p.returncode == 2 and message in p.stderr


def test_attention_implementation_as_the_job_states_it(tmp_path):
    """--attention: eager runs the model's own code, whose scores [batch, heads, seq, seq] are
    kept for backward (no SDPA kernel runs); flash runs SDPA's flash kernel where the GPU and
    dtype allow it — an fp32 job or a V100 is refused in one line, never traced with another
    kernel; a model that is not Hugging Face's refuses the flag."""
    pytest.importorskip("transformers")
    batch, seq, heads = 2, 128, 4
    common = [LLAMA_16K, "--batch", str(batch), "--seq-len", str(seq), "--gpu-capability", "8.0"]

    def sdpa_ops(evs):
        return {e["op"] for e in evs if e["ev"] == "op" and "scaled_dot_product" in e["op"]}

    _, default = traced([*common, "--precision", "bf16"], tmp_path)
    header, eager = traced([*common, "--precision", "bf16", "--attention", "eager"], tmp_path)
    assert header["options"]["attention"] == "eager"
    scores = batch * heads * seq * seq * 2
    assert not sdpa_ops(eager) and any(e["bytes"] == scores for e in allocs(eager))
    assert live_and_peak(eager)[1] > live_and_peak(default)[1]
    _, flash = traced([*common, "--precision", "bf16", "--attention", "flash"], tmp_path)
    assert "_scaled_dot_product_flash_attention" in sdpa_ops(flash)
    for refused in (["--precision", "fp32"], ["--precision", "bf16", "--gpu-capability", "7.0"]):
        p, _ = run([*common, "--attention", "flash", *refused], tmp_path)
        assert p.returncode == 2 and "flash attention cannot run this call" in p.stderr
    p, _ = run(["timm:resnet18", "--batch", "2", "--attention", "eager"], tmp_path)
    assert p.returncode == 2 and "--attention applies to Hugging Face models" in p.stderr
    flash_key = LLAMA_16K[:-1] + ",attn_implementation=flash_attention_2)"
    p, _ = run([flash_key, "--batch", "2", "--precision", "bf16"], tmp_path)
    assert p.returncode == 2 and "give --attention flash" in p.stderr


def test_optimizer_in_backward_frees_each_gradient_after_its_step(tmp_path):
    """torchtune's optimizer_in_bwd: each parameter is stepped as its gradient is ready, and that
    gradient freed — the gradients never all live at once, while the optimizer's state is the
    same as a step after backward."""
    pytest.importorskip("transformers")
    ref = "hf:LlamaForCausalLM(hidden_size=256,intermediate_size=512,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,vocab_size=512)"

    def trace(*extra):
        header, evs = traced(
            [ref, "--batch", "2", "--seq-len", "32", "--optimizer", "adamw", *extra], tmp_path
        )
        # The most bytes of gradients alive at once (the tracer labels each where it is made).
        sizes, live, most = {}, 0, 0
        for e in evs:
            if e["ev"] == "alloc" and e["category"] == "gradient":
                sizes[e["id"]] = e["bytes"]
                live += e["bytes"]
                most = max(most, live)
            elif e["ev"] == "free" and e["id"] in sizes:
                live -= sizes.pop(e["id"])
        state = sum(e["bytes"] for e in allocs(evs, category="optimizer_state"))
        return header, most, state

    header, grads_in_backward, state_in_backward = trace("--optimizer-in-backward")
    assert header["options"]["optimizer_in_backward"] is True
    _, grads_after, state_after = trace()
    params = header["parameters"] * 4
    assert state_in_backward == state_after >= 2 * params
    assert grads_after >= params
    assert 0 < grads_in_backward < params / 2


def test_kept_gradients_live_through_the_next_forward(tmp_path):
    """``zero_grad(set_to_none=False)`` (torch before 2.0's default): the gradients are zeroed in
    place, so every later forward runs beside all of them, and backward makes none anew; by
    default each step's forward runs with none."""
    pytest.importorskip("transformers")
    ref = "hf:LlamaForCausalLM(hidden_size=256,intermediate_size=512,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,vocab_size=512)"

    def trace(*extra):
        header, evs = traced(
            [ref, "--batch", "2", "--seq-len", "32", "--optimizer", "adamw", *extra], tmp_path
        )
        # Gradient bytes alive as each iteration's forward starts, and gradients made per iteration.
        sizes, live, at_forward, made, it, seen = {}, 0, [], [0], 0, False
        for e in evs:
            if e["ev"] == "iteration":
                it, seen = it + 1, False
                made.append(0)
            elif e["ev"] == "alloc":
                if e["category"] == "activation" and not seen:
                    at_forward.append(live)
                    seen = True
                if e["category"] == "gradient":
                    sizes[e["id"]] = e["bytes"]
                    live += e["bytes"]
                    made[it] += 1
            elif e["ev"] == "free" and e["id"] in sizes:
                live -= sizes.pop(e["id"])
        return header, at_forward, made[: len(at_forward)]

    header, kept, made_kept = trace("--keep-grads")
    assert header["options"]["keep_grads"] is True
    _, freed, made_freed = trace()
    grads = header["parameters"] * 4
    assert len(kept) >= 3 and kept[0] == 0 and all(g == grads for g in kept[1:]), kept
    assert all(g == 0 for g in freed), freed
    assert made_kept[0] > 0 and not any(made_kept[1:]), made_kept
    assert all(n == made_freed[0] > 0 for n in made_freed), made_freed


def phase_peaks(evs):
    """Each part of a whole run's most allocated bytes, the parts before it included, and the
    allocations it made."""
    sizes, live, peaks, made, part = {}, 0, {}, {}, None
    for e in evs:
        if e["ev"] == "run_phase":
            part = e["name"]
            peaks.setdefault(part, live)
            made.setdefault(part, [])
        elif e["ev"] == "alloc":
            sizes[e["id"]] = e["bytes"]
            live += e["bytes"]
            if part is not None:
                peaks[part] = max(peaks[part], live)
                made[part].append(e)
        elif e["ev"] == "free":
            live -= sizes.pop(e["id"])
    return peaks, made


def test_whole_run_evaluation_keeps_logits_until_accumulation_moves_them(tmp_path):
    """Hugging Face Trainer's own evaluation loop after the steps (transformers' Trainer run on
    the stand-in CUDA): without metrics each batch's
    loss alone is kept, and the evaluation's peak does not grow with its batches; with metrics
    the logits of every batch are concatenated on the GPU (transformers' nested_concat), so it
    grows with them — unless eval_accumulation_steps moves them to the host, which keeps it
    flat."""
    pytest.importorskip("transformers")
    batch, seq, vocab = 4, 64, 4000
    common = [
        LLAMA_16K[: LLAMA_16K.index("vocab_size=")] + f"vocab_size={vocab})",
        "--batch",
        str(batch),
        "--seq-len",
        str(seq),
        "--precision",
        "bf16",
        "--whole-run",
    ]

    def evaluate(*extra):
        header, evs = traced([*common, *extra], tmp_path)
        check_valid([header, *evs])
        assert [e["name"] for e in evs if e["ev"] == "run_phase"] == ["load", "train", "evaluate"][
            : 3 if extra else 2
        ]
        return header, phase_peaks(evs)

    header, (peaks, _) = evaluate()
    assert header["options"]["whole_run"] == {} and "evaluate" not in peaks
    header, _ = evaluate("--eval-batches", "1")
    # One GPU's Hugging Face job: the Trainer's own evaluate() ran, on the stand-in CUDA.
    assert header["evaluation_loop"].startswith("transformers.Trainer ")
    # A rank of a multi-GPU job: gpumem's restatement, its gathers as world-sized tensors.
    header, _ = evaluate("--eval-batches", "1", "--strategy", "ddp", "--world-size", "2")
    assert header["evaluation_loop"].startswith("gpumem ")
    # fp32: the Trainer in 16 bits gets its outputs from accelerate converted to fp32.
    logits = batch * seq * vocab * 4
    _, (loss_4, _) = evaluate("--eval-batches", "4")
    _, (loss_8, _) = evaluate("--eval-batches", "8")
    # Losses only: four more batches add their losses (fp32, one per sample), nothing else.
    assert loss_8["evaluate"] - loss_4["evaluate"] == 4 * batch * 4
    _, (kept_4, made) = evaluate("--eval-batches", "4", "--eval-logits")
    _, (kept_8, _) = evaluate("--eval-batches", "8", "--eval-logits")
    # Concatenation holds the old and the new together: four more batches, at least 4 logits.
    assert kept_8["evaluate"] - kept_4["evaluate"] >= 4 * logits
    assert any(e["bytes"] == 4 * logits and e["op"] == "cat" for e in made["evaluate"])
    header, evs = traced(
        [*common, "--eval-batches", "4", "--eval-logits", "--eval-accumulation-steps", "1"],
        tmp_path,
    )
    moved_4, _ = phase_peaks(evs)
    # After each move to the host the loop empties the allocator's cache.
    assert sum(e["ev"] == "empty_cache" for e in evs) == 4
    _, (moved_8, _) = evaluate(
        "--eval-batches", "8", "--eval-logits", "--eval-accumulation-steps", "1"
    )
    assert moved_8["evaluate"] == moved_4["evaluate"] < kept_4["evaluate"], "moved: flat"
    # A larger evaluation batch than the training's raises the evaluation's peak.
    _, (wide, _) = evaluate("--eval-batches", "2", "--eval-batch-size", str(4 * batch))
    assert wide["evaluate"] > loss_4["evaluate"]
    # include_for_metrics=["inputs"]: each batch's token ids are kept too (seven batches' of
    # them beside the eighth batch's logits).
    _, (inputs_8, _) = evaluate("--eval-batches", "8", "--eval-logits", "--eval-inputs")
    assert inputs_8["evaluate"] - kept_8["evaluate"] >= 7 * batch * seq * 8
    # eval_do_concat_batches=False: a list of batches, never the old and the longer copy at
    # once — the Trainer's own loop, and the restatement a DDP rank gets.
    _, (listed_8, _) = evaluate("--eval-batches", "8", "--eval-logits", "--eval-no-concat")
    assert kept_4["evaluate"] < listed_8["evaluate"] < kept_8["evaluate"]
    ddp = ["--strategy", "ddp", "--world-size", "2"]
    _, (ddp_kept, _) = evaluate("--eval-batches", "8", "--eval-logits", *ddp)
    _, (ddp_listed, _) = evaluate("--eval-batches", "8", "--eval-logits", "--eval-no-concat", *ddp)
    assert ddp_listed["evaluate"] < ddp_kept["evaluate"]


def test_whole_run_loads_a_4bit_model_one_16bit_weight_at_a_time(tmp_path):
    """A QLoRA whole run's load is transformers' quantized load: each linear weight reaches the
    GPU in 16 bits and is quantized there, so the load holds the quantized model plus at most
    one 16-bit weight; a 16-bit load holds the model once, nothing staged."""
    pytest.importorskip("transformers")
    common = [LLAMA_16K, "--batch", "2", "--seq-len", "32", "--precision", "bf16", "--whole-run"]
    lora = ["--lora-rank", "8", "--lora-targets", "all-linear"]

    def load(*extra):
        _, evs = traced([*common, *extra], tmp_path)
        peaks, made = phase_peaks(evs)
        return peaks["load"], made["load"]

    peak, made = load(*lora, "--lora-quant", "nf4")
    staged = [e["bytes"] for e in made if e["category"] == "temporary"]
    kept = sum(e["bytes"] for e in made if e["category"] != "temporary")
    # 2 layers of 7 linear layers (q, k, v, o, gate, up, down), each staged in bf16 and freed.
    assert len(staged) == 2 * 7 and max(staged) == 128 * 64 * 2
    assert kept <= peak <= kept + max(staged)
    peak_16, made_16 = load(*lora)
    assert not any(e["category"] == "temporary" for e in made_16)
    assert peak_16 == sum(e["bytes"] for e in made_16)
    # Each quantized weight holds a quarter of its 16-bit bytes, plus statistics and codes.
    assert peak_16 - kept > 0.5 * sum(staged)


def test_whole_run_qlora_under_autocast_loads_as_its_recipe_does(tmp_path):
    """QLoRA under autocast (amp-bf16), as its recipe runs: from_pretrained(dtype=bf16) loads
    every weight in bf16 (the linear ones quantized as they come), PEFT's
    prepare_model_for_kbit_training then casts the others (embeddings, norms, the head) to
    fp32 one at a time, and only then does get_peft_model make the fp32 LoRA factors."""
    pytest.importorskip("transformers")
    args = [LLAMA_16K, "--batch", "2", "--seq-len", "32", "--precision", "amp-bf16", "--whole-run"]
    header, evs = traced(
        [*args, "--lora-rank", "8", "--lora-targets", "all-linear", "--lora-quant", "nf4"],
        tmp_path,
    )
    peaks, made = phase_peaks(evs)
    kept = [e for e in made["load"] if e["category"] == "parameter"]
    table = 16000 * 64  # the embeddings' and the head's elements
    order = lambda nbytes: [i for i, e in enumerate(kept) if e["bytes"] == nbytes]
    in_bf16, in_fp32 = order(table * 2), order(table * 4)
    assert len(in_bf16) == len(in_fp32) == 2, "each table loaded in bf16, then cast to fp32"
    assert max(in_bf16) < min(in_fp32)
    # After the last cast: the LoRA factors, PEFT's trainable parameters in fp32, and no more.
    assert sum(e["bytes"] for e in kept[max(in_fp32) + 1 :]) == header["parameters"] * 4
    # Casting the head: the fp32 embeddings, the bf16 head and its fp32 copy at once.
    assert peaks["load"] >= table * (4 + 2 + 4)
    # PEFT (0.21 and later) empties the allocator's cache after the casts (auto_clear_cache).
    try:
        from peft import prepare_model_for_kbit_training as prepare
    except ImportError:
        clears = False
    else:
        clears = "auto_clear_cache" in inspect.signature(prepare).parameters
    load = evs[: next(i for i, e in enumerate(evs) if e.get("name") == "train")]
    assert any(e["ev"] == "empty_cache" for e in load) == clears


def test_trainer_in_16_bits_gets_fp32_outputs_and_tied_weights_load_once(tmp_path):
    """Hugging Face's Trainer in bf16: accelerate returns the forward's outputs converted to
    fp32, so each step makes fp32 logits twice, the loss's and the output's (a loop that holds
    its outputs is not the Trainer's: the loss's alone). A model whose head is tied to its
    embeddings reaches the GPU with that table once."""
    pytest.importorskip("transformers")
    batch, seq, vocab = 2, 32, 16000
    tied = LLAMA_16K[:-1] + ",tie_word_embeddings=true)"
    args = [tied, "--batch", str(batch), "--seq-len", str(seq), "--precision", "bf16"]
    fp32_logits = lambda evs: [
        e
        for e in allocs(evs, phase="forward", op="_to_copy")
        if e["bytes"] == batch * seq * vocab * 4
    ]
    _, trainer = traced(args, tmp_path)
    _, kept = traced([*args, "--outputs", "kept"], tmp_path)
    assert len(fp32_logits(trainer)) == 2 * len(fp32_logits(kept)) > 0
    _, evs = traced([*args, "--whole-run"], tmp_path)
    _, made = phase_peaks(evs)
    assert sum(e["bytes"] == vocab * 64 * 2 for e in made["load"]) == 1


def test_whole_run_fsdp_save_gathers_as_pytorch_state_dicts_do(tmp_path):
    """An FSDP2 checkpoint at world size 4, made by torch.distributed.checkpoint's own
    get_model_state_dict/get_optimizer_state_dict: `full` gathers every parameter and AdamW
    state whole onto the GPU and holds them all; `full-offload` sends each to the host as it is
    gathered, so the GPU holds one at a time; `sharded` gathers nothing."""
    pytest.importorskip("transformers")
    common = [
        LLAMA_16K,
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--optimizer",
        "adamw",
        "--strategy",
        "fsdp",
        "--world-size",
        "4",
    ]

    def save(how):
        """What the save allocates, and how far it rises above the sharded save's peak."""
        header, evs = traced([*common, "--save", how], tmp_path)
        check_valid([header, *evs])
        peaks, made = phase_peaks(evs)
        return made["save"], peaks["save"]

    full_model = (64 * 16000 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64) * 4  # fp32
    sharded, base = save("sharded")
    assert not sharded, "a sharded save gathers nothing"
    made, peak = save("full")
    # The model and AdamW's two states, whole, all held at once.
    assert peak - base >= 3 * full_model and sum(e["bytes"] for e in made) >= 3 * full_model
    # One gathered tensor at a time (beside the collective's own buffer).
    made, peak = save("full-offload")
    assert peak - base <= 2 * max(e["bytes"] for e in made) < full_model


def test_whole_run_zero3_full_save_gathers_one_module_at_a_time(tmp_path):
    """DeepSpeed ZeRO-3's consolidated 16-bit save (stage3_gather_16bit_weights_on_model_save)
    at world size 4: module by module its own parameters are gathered whole on the GPU, copied
    to the host and partitioned again — one module's at a time, never the model; parameters
    under param_persistence_threshold stay gathered from the steps. Its per-rank save
    (sharded) gathers nothing."""
    pytest.importorskip("transformers")
    common = [LLAMA_16K, "--batch", "2", "--seq-len", "32", "--precision", "bf16"]
    common += ["--optimizer", "adamw", "--strategy", "zero3", "--world-size", "4"]

    def save(how):
        header, evs = traced([*common, "--save", how], tmp_path)
        check_valid([header, *evs])
        saving, gathered, live, most = False, [], set(), 0
        for e in evs:
            if e["ev"] == "run_phase":
                saving = e["name"] == "save"
            elif saving and e["ev"] == "alloc" and e["op"] == "zero3_gathered":
                gathered.append(e["bytes"])
                live.add(e["id"])
                most = max(most, len(live))
            elif e["ev"] == "free":
                live.discard(e["id"])
        return gathered, most

    assert save("sharded") == ([], 0)
    gathered, most = save("full")
    # The embeddings and the head (16000 x 64 each, above the threshold), whole, in bf16, one
    # at a time; the layers' small weights were gathered already.
    assert gathered == [64 * 16000 * 2] * 2 and most == 1


def test_whole_run_resume_reads_the_optimizer_state_in_at_the_load(tmp_path):
    """Resumed, the checkpoint's optimizer state is read in during the load beside the live
    model — on one GPU as torch.load onto the GPU (Hugging Face's Trainer), under FSDP2 at world
    size 4 as torch.distributed.checkpoint's sharded load (a rank's shard of it) — and the first
    step no longer makes it."""
    pytest.importorskip("transformers")
    common = [LLAMA_16K, "--batch", "2", "--seq-len", "32", "--optimizer", "adamw"]
    full_model = (64 * 16000 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64) * 4  # fp32
    for layout, share in (([], 1), (["--strategy", "fsdp", "--world-size", "4"], 4)):
        runs = {}
        for resumed in (False, True):
            flags = [*common, *layout, "--resume" if resumed else "--whole-run"]
            header, evs = traced(flags, tmp_path)
            check_valid([header, *evs])
            runs[resumed] = phase_peaks(evs)
        (fresh_peaks, fresh_made), (peaks, made) = runs[False], runs[True]
        adamw = 2 * full_model // share  # exp_avg and exp_avg_sq, a rank's share

        def made_in(part, m):
            return sum(e["bytes"] for e in m[part])

        assert made_in("load", made) - made_in("load", fresh_made) >= 0.99 * adamw, layout
        assert made_in("train", fresh_made) - made_in("train", made) >= 0.99 * adamw, layout
        if not layout:
            # On one GPU the load's peak is the model and the state read in beside it. (An FSDP2
            # rank's load peaks earlier, the whole model built before it is sharded.)
            assert peaks["load"] - fresh_peaks["load"] >= 0.99 * adamw


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_whole_run_zero_resume_reads_the_state_in_beside_the_live_one(tmp_path, stage):
    """DeepSpeed's load_checkpoint under ZeRO at world size 4: the base optimizer's
    load_state_dict reads the rank's moments in beside those DeepSpeed made at construction,
    which die once they are replaced — the load allocates the moments once more and its peak
    grows by at most them, while the steps, whose state was there already, are unchanged."""
    pytest.importorskip("transformers")
    common = [LLAMA_16K, "--batch", "2", "--seq-len", "32", "--precision", "bf16"]
    common += ["--optimizer", "adamw", "--strategy", stage, "--world-size", "4"]
    runs = {}
    for resumed in (False, True):
        header, evs = traced([*common, "--resume" if resumed else "--whole-run"], tmp_path)
        runs[resumed] = phase_peaks(evs)
    (fresh_peaks, fresh_made), (peaks, made) = runs[False], runs[True]
    moments = sum(e["bytes"] for e in fresh_made["load"] if e["op"] == "zero_optimizer_state")
    read = [e["bytes"] for e in made["load"] if e["op"] == "zero_load_state"]
    assert len(read) == 2 and sum(read) == moments > 0
    assert 0 < peaks["load"] - fresh_peaks["load"] <= moments
    assert peaks["train"] == fresh_peaks["train"]


def test_whole_run_broadcast_load_holds_one_whole_parameter_beside_the_shards(tmp_path):
    """FSDP2 at world size 4 loading from rank 0 (accelerate's cpu_ram_efficient_loading):
    every entry of the state dict arrives whole on each rank's GPU, one at a time, beside the
    rank's shards — the largest being the embeddings (16000 x 64, fp32). The load's peak stays
    where it was: fully_shard's own split of each whole parameter is as large."""
    pytest.importorskip("transformers")
    common = [LLAMA_16K, "--batch", "2", "--seq-len", "32", "--optimizer", "adamw"]
    common += ["--strategy", "fsdp", "--world-size", "4"]
    runs = {}
    for broadcast in (False, True):
        header, evs = traced(
            [*common, "--broadcast-load" if broadcast else "--whole-run"], tmp_path
        )
        runs[broadcast] = (phase_peaks(evs), evs)
    ((fresh_peaks, fresh_made), _), ((peaks, made), evs) = runs[False], runs[True]
    whole = made["load"][len(fresh_made["load"]) :]
    assert {(e["op"], e["category"]) for e in whole} == {("empty", "temporary")}
    # 2 layers of 9 entries (4 attention and 3 MLP weights, 2 norms), the final norm, the
    # embeddings and the head.
    assert len(whole) == 2 * 9 + 3 and max(e["bytes"] for e in whole) == 64 * 16000 * 4
    ids = {e["id"] for e in whole}
    alive = most = 0
    for e in evs:
        if e.get("id") in ids:
            alive += 1 if e["ev"] == "alloc" else -1
            most = max(most, alive)
    assert most == 1
    assert peaks == fresh_peaks


def test_whole_run_generation_grows_the_models_own_key_value_cache(tmp_path):
    """--generate-tokens: model.generate()'s loop after the steps, through the model's own
    DynamicCache: the generation's peak grows with the tokens by at least the cache they add
    (keys and values, every layer, in bf16), and each token's sampling holds the last position's
    logits in fp32 and their probabilities — and, with top-p, their sorted copy."""
    pytest.importorskip("transformers")
    batch, seq, vocab = 4, 32, 16000
    layers, kv_heads, head_dim = 2, 4, 16

    def generate(tokens, *extra):
        header, evs = traced(
            [
                LLAMA_16K,
                "--batch",
                str(batch),
                "--seq-len",
                str(seq),
                "--precision",
                "bf16",
                "--generate-tokens",
                str(tokens),
                *extra,
            ],
            tmp_path,
        )
        check_valid([header, *evs])
        assert [e["name"] for e in evs if e["ev"] == "run_phase"] == ["load", "train", "generate"]
        assert header["options"]["whole_run"]["generation"]["new_tokens"] == tokens
        peaks, made = phase_peaks(evs)
        return peaks["generate"], made["generate"]

    short, made = generate(16)
    long, _ = generate(80)
    per_token = 2 * layers * batch * kv_heads * head_dim * 2
    assert long - short >= 64 * per_token
    scores = batch * vocab * 4
    assert sum(e["bytes"] == scores for e in made) >= 3 * 16  # copy, scores, probabilities
    one_layer_key = per_token // layers // 2
    assert any(e["op"] == "cat" and e["bytes"] == one_layer_key * (seq + 1) for e in made)
    # Prompts of their own length (TRL's max_prompt_length): the cache starts from it.
    _, made = generate(16, "--generate-prompt-len", "8")
    assert any(e["op"] == "cat" and e["bytes"] == one_layer_key * 9 for e in made)
    # Top-k and top-p, transformers' own warpers: top-p sorts every token's score each step
    # (the values in fp32, their indices in int64), then its softmax's cumulative sum.
    assert not any(e["op"] in ("sort", "cumsum") for e in made)
    _, made = generate(16, "--generate-top-k", "50", "--generate-top-p", "0.9")
    for op, nbytes in [("sort", scores), ("sort", 2 * scores), ("cumsum", scores)]:
        assert sum(e["op"] == op and e["bytes"] == nbytes for e in made) == 16, (op, nbytes)


def test_an_encoder_decoder_generates_from_its_encoders_output(tmp_path):
    """--generate-tokens on T5: the encoder once over the prompts, then the decoder token by
    token from its start token, through transformers' EncoderDecoderCache — the decoder's own
    keys and values grow by a token a step in every layer, the cross-attention's are the
    prompts' length, made once per layer and kept."""
    pytest.importorskip("transformers")
    batch, seq, tokens, layers, heads, d_kv = 2, 32, 8, 2, 4, 16
    t5 = (
        f"hf:T5ForConditionalGeneration(d_model=64,d_ff=128,num_layers={layers},"
        f"num_decoder_layers={layers},num_heads={heads},d_kv={d_kv},vocab_size=1000)"
    )
    header, evs = traced(
        [t5, "--batch", str(batch), "--seq-len", str(seq), "--precision", "bf16"]
        + ["--generate-tokens", str(tokens)],
        tmp_path,
    )
    check_valid([header, *evs])
    _, made = phase_peaks(evs)
    cats = [e["bytes"] for e in made["generate"] if e["op"] == "cat"]
    per_token = batch * heads * d_kv * 2  # one layer's keys (or values) of one token, bf16
    for n in range(1, tokens + 1):
        assert cats.count(n * per_token) == 2 * layers, (n, sorted(cats))
    assert cats.count(seq * per_token) == 2 * layers  # cross-attention's, made once
    # The decoder's ids, from its start token: one int64 per prompt more each step.
    assert all(batch * 8 * (n + 1) in cats for n in range(1, tokens + 1))


def test_a_gpt_layers_activations_are_korthikantis_closed_form(tmp_path):
    """Korthikanti et al. (arXiv 2205.05198, eq. 1): a GPT layer — multi-head attention without
    GQA, LayerNorm, GELU, dropout on, no recomputation, trained as Megatron trains fp16 (model
    and activations in fp16, master weights apart) — keeps s·b·h·(34 + 5·a·s/h) bytes for
    backward, and with tensor and sequence parallelism over t ranks 1/t of it (their eq. 4).
    BioGPT is that layer (separate q/k/v projections, learned positions, eager attention); its
    traced activations per layer, the difference of a 4- and a 2-layer model at the end of
    forward, are within 2% of it at two sequence lengths, so both the s·b·h and the attention's
    a·s²·b terms are checked, at t = 1, 2 and 4 (BioGPT given Megatron's layout as its
    tensor-parallel plan). Where PyTorch's sequence parallelism differs from Megatron's, the
    trace shows it: each column-wise layer's input is all-gathered by DTensor and saved whole by
    the layer (q/k/v share one, fc1 has its own), where Megatron saves the rank's part and
    gathers it again in backward — 2 × 2·s·b·h·(1 − 1/t) bytes more, added to the formula.
    Their selective recomputation (eq. 6; Megatron's and NeMo's ``selective``,
    ``--checkpointing=selective-attention``) drops the a·s²·b term: 34·s·b·h/t. (Under torch's
    autocast the layout differs — an fp32 residual stream and softmax and autocast's fp16
    copies: docs/parallelism.md.)"""
    import torch

    h, a, b = 512, 8, 2
    plan = json.dumps(
        {
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise",
            "layers.*.self_attn.out_proj": "rowwise",
            "layers.*.fc1": "colwise",
            "layers.*.fc2": "rowwise",
        },
        separators=(",", ":"),
    )

    def kept(layers, s, t, checkpointing="off", sequence_parallel=True):
        ref = (
            f"hf:BioGptForCausalLM(hidden_size={h},num_attention_heads={a},intermediate_size={4 * h},"
            f"num_hidden_layers={layers},vocab_size=1024,max_position_embeddings=1024,"
            "hidden_dropout_prob=0.1,attention_probs_dropout_prob=0.1,activation_dropout=0.0,layerdrop=0.0,"
            f"base_model_tp_plan={plan})"
        )
        _, evs = traced(
            [ref, "--batch", str(b), "--seq-len", str(s), "--precision", "fp16"]
            + ["--attention", "eager", f"--checkpointing={checkpointing}"]
            + (["--tp", str(t)] if t > 1 else [])
            + ([] if sequence_parallel else ["--no-sequence-parallel"]),
            tmp_path,
        )
        live, iteration = {}, 0
        for e in evs:
            iteration += e["ev"] == "iteration"
            if e["ev"] == "alloc":
                if e["phase"] == "backward" and iteration >= 2:
                    break
                live[e["id"]] = e["bytes"] if e["category"] == "activation" else 0
            elif e["ev"] == "free":
                live.pop(e["id"], None)
        return sum(live.values())

    tp = (1, 2, 4) if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6) else (1,)
    gathered = lambda s, t: 4 * s * b * h * (1 - 1 / t)  # noqa: E731
    for t in tp:
        for s in (256, 512):
            per_layer = (kept(4, s, t) - kept(2, s, t)) / 2
            formula = s * b * h * (34 + 5 * a * s / h) / t + gathered(s, t)
            assert abs(per_layer / formula - 1) < 0.02, (t, s, per_layer, formula)
    for t, s in [(1, 256), (1, 512), *((t, 512) for t in tp[1:])]:
        mode = "selective-attention"
        per_layer = (kept(4, s, t, mode) - kept(2, s, t, mode)) / 2
        formula = s * b * h * 34 / t + gathered(s, t)
        assert abs(per_layer / formula - 1) < 0.02, (mode, t, s, per_layer, formula)
    # Without sequence parallelism (their eq. 2): the two norms' inputs, the two dropouts' masks
    # on the stream and the column-wise layers' inputs stay whole on every rank, 10·s·b·h;
    # what runs inside the attention and the MLP is split. No all-gather: nothing added.
    for t in tp[1:]:
        s = 512
        per_layer = (
            kept(4, s, t, sequence_parallel=False) - kept(2, s, t, sequence_parallel=False)
        ) / 2
        formula = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert abs(per_layer / formula - 1) < 0.02, ("no sp", t, s, per_layer, formula)


def test_a_ranks_parameters_are_megatrons_most_loaded_shard(tmp_path):
    """Megatron-LM's ``compute_weight_and_optimizer_memory`` (megatron/training/
    theoretical_memory_usage.py at NVIDIA/Megatron-LM 38644dd756c46142787b1bd5dc08ed82ca0e6de1),
    restated: the most loaded rank of TP = t × PP = p holds ((the layers' parameters)/p + one
    embedding)/t, plus the untied head where p = 1, the layers' parameters being
    2·L·h²·(1 + ffn/h + g/a + 2/h + 1/(L·h)) (no linear biases; LayerNorms of weight and bias).
    A Llama rank traced under TP × PP (stage 0: the embedding and the first layers) holds exactly
    that, with two differences of layout put in: its RMSNorms have a weight only (h each, not
    2h) and PyTorch keeps them whole on every rank where the formula divides them by t; and
    SwiGLU's three matrices of size I are the formula's MLP at ffn = 3I/2 (the gated factor later
    commits add). The bytes per parameter differ by design — Megatron's 18 (a bf16 model, fp32
    gradient and master copy, Adam) against the 16 of PyTorch's autocast (an fp32 model and
    gradient, Adam) — and the distributed optimizer (6 + 12/dp) has no counterpart with TP here:
    docs/parallelism.md."""
    import torch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
        return  # the DTensor plans as the tracer uses them
    h, a, g, layers, inter, vocab = 256, 8, 4, 4, 512, 1024
    ref = (
        f"hf:LlamaForCausalLM(hidden_size={h},intermediate_size={inter},num_hidden_layers={layers},"
        f"num_attention_heads={a},num_key_value_heads={g},vocab_size={vocab},tie_word_embeddings=false)"
    )

    def megatron(t, p):
        ffn = 3 * inter / 2
        in_layers = 2 * layers * h * h * (1 + ffn / h + g / a + 2 / h + 1 / (layers * h))
        embedding = h * vocab
        most_loaded = (in_layers / p + embedding) / t
        if p == 1:
            most_loaded += embedding / t
        return most_loaded, (4 * layers * h + 2 * h) / p / t  # and its norms' share

    def traced_parameters(t, p):
        extra = (["--tp", str(t)] if t > 1 else []) + (
            ["--pp", str(p), "--pp-rank", "0", "--microbatches", str(p)] if p > 1 else []
        )
        _, evs = traced([ref, "--batch", str(2 * p), "--seq-len", "64", *extra], tmp_path)
        live = {}
        for e in evs:
            if e["ev"] == "alloc" and e["category"] == "parameter" and e["phase"] == "setup":
                live[e["id"]] = e["bytes"]
            elif e["ev"] == "free":
                live.pop(e["id"], None)
        return sum(live.values())

    buffers = 2 * (h // a // 2) * 4  # the rotary tables (inv_freq and its original), fp32
    for t, p in [(1, 1), (2, 1), (4, 1), (2, 2)]:
        formula, norms = megatron(t, p)
        rms_norms = 2 * h * layers // p + (h if p == 1 else 0)  # whole on every rank
        expected = formula - norms + rms_norms
        assert traced_parameters(t, p) == 4 * expected + buffers, (t, p)


def test_the_routers_stand_in_counts():
    """routing.Routing's counts of 8 experts among 1,024 tokens' top-2 choices: even without
    expert parallelism whatever the imbalance (every expert is the rank's); with 4 ranks the
    traced rank's 2 experts get F times their share, up to every token's choices (a token picks
    an expert once: at most 2 of its 2 choices on a rank of 2 experts), the rest evenly."""
    import torch

    from gpumem_trace.routing import Routing

    ids = torch.empty(1024, 2, dtype=torch.long, device="meta").view(-1)
    assert Routing(1, 4.0).counts(ids, 8).tolist() == [256] * 8
    assert Routing(4, 1.0).counts(ids, 8).tolist() == [256] * 8
    assert Routing(4, 2.0).counts(ids, 8).tolist() == [512, 512, 171, 171, 171, 171, 170, 170]
    capped = Routing(4, 100.0).counts(ids, 8).tolist()
    assert capped[:2] == [1024, 1024] and sum(capped) == 2048, capped
    with pytest.raises(ValueError, match="not a number ≥ 1"):
        Routing(4, 0.5)


def test_liger_runs_its_own_python_as_on_the_gpu(tmp_path):
    """--liger: Liger's kernels in place of the model's ops, by Liger's own code (its Triton
    launches do nothing on meta). Its fused linear cross-entropy never makes the logits: in
    forward it makes the head's gradient (V × H, fp32 under amp) and one chunk of logits at a
    time — Liger's chunk, the next power of two of BT / ⌈V / H⌉ — and, reading its tensors as
    CUDA ones, accumulates the head's gradient in place (its fallback for other devices makes a
    V × H temporary per chunk)."""
    pytest.importorskip("liger_kernel")
    batch, seq, hidden, vocab = 2, 256, 128, 16000
    model = f"hf:LlamaForCausalLM(hidden_size={hidden},intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size={vocab})"
    common = [model, "--batch", str(batch), "--seq-len", str(seq), "--precision", "amp-bf16"]
    _, plain = traced(common, tmp_path)
    header, liger = traced([*common, "--liger"], tmp_path)
    assert header["options"]["liger"] == {}
    logits = batch * seq * vocab * 4
    assert max(e["bytes"] for e in allocs(plain)) >= logits
    head = vocab * hidden * 4  # < logits: the largest tensor is a (V × H) one, no logits
    assert max(e["bytes"] for e in allocs(liger) if e.get("category") != "workspace") == head
    loss = [e for e in allocs(liger, phase="forward", module="LlamaForCausalLM")]
    assert len([e for e in loss if e["bytes"] == head]) == header["iterations"]
    chunk = 2 ** math.ceil(math.log2(math.ceil(batch * seq / math.ceil(vocab / hidden))))
    assert len([e for e in loss if e["bytes"] == chunk * vocab * 2]) >= batch * seq // chunk - 1
    assert live_and_peak(liger)[1] < live_and_peak(plain)[1] - logits // 2


def test_a_kl_reference_is_a_frozen_copy_scoring_each_batch(tmp_path):
    """--reference-model (TRL's KL reference with beta > 0 and no PEFT): a frozen copy of the
    model beside it — its weights once more in setup, no gradient or optimizer state of its
    own — whose no-grad forward scores each step's batch (its logits, then one log-probability
    per token) before the model's."""
    batch, seq, vocab = 2, 96, 1000  # logits of another size than any weight's
    model = (
        "hf:LlamaForCausalLM(hidden_size=128,intermediate_size=256,num_hidden_layers=2,"
        f"num_attention_heads=4,num_key_value_heads=2,vocab_size={vocab})"
    )

    def run(*extra):
        header, evs = traced(
            [
                model,
                "--batch",
                str(batch),
                "--seq-len",
                str(seq),
                "--precision",
                "amp-bf16",
                *extra,
            ],
            tmp_path,
        )
        by = {}
        for e in allocs(evs):
            key = (e["phase"], e["category"])
            by[key] = by.get(key, 0) + e["bytes"]
        logits = len(allocs(evs, phase="forward", bytes=batch * seq * vocab * 2))
        return header, by, logits

    _, plain, plain_logits = run()
    header, scored, scored_logits = run("--reference-model")
    assert header["options"]["reference_model"] is True
    assert scored[("setup", "parameter")] == 2 * plain[("setup", "parameter")]
    assert scored.get(("backward", "gradient")) == plain.get(("backward", "gradient"))
    assert scored_logits == plain_logits + header["iterations"]
