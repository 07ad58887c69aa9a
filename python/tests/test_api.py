"""The gpumem package as a user installs it (the gpumem-estimate wheel, scripts/wheel.sh): its
API answers what the `gpumem` command in the same wheel answers for the same job, to the byte;
live model objects are sized as their references are and left untouched; failures are typed.

Run from outside python/ with the wheel's environment (scripts/test.sh does), so that `gpumem`
is the installed package; elsewhere these tests skip, unless GPUMEM_TEST_REQUIRE_WHEEL is set."""

import json
import os
import runpy
import shutil
import subprocess
import sys
import threading
import time

import pytest

try:
    import gpumem  # python/gpumem without its native module, where the wheel is not installed
except ImportError:
    if os.environ.get("GPUMEM_TEST_REQUIRE_WHEEL"):
        raise
    pytest.skip("the gpumem wheel is not installed here", allow_module_level=True)
torch = pytest.importorskip("torch")

GPT2 = "n_layer=2,n_embd=128,n_head=4,vocab_size=1000,n_positions=256"
LORA = {"rank": 8, "alpha": 16, "targets": ["c_attn"]}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test traces afresh (the command and the package share this cache)."""
    monkeypatch.setenv("GPUMEM_CACHE", str(tmp_path / "cache"))


def command(*args):
    """The `gpumem` command the wheel installed beside this interpreter, its JSON answer."""
    exe = os.path.join(os.path.dirname(sys.executable), "gpumem")
    out = subprocess.run([exe, *args, "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_wheel_installs_the_real_command_and_the_installed_package():
    exe = shutil.which("gpumem", path=os.path.dirname(sys.executable))
    with open(exe, "rb") as f:
        assert f.read(4) == b"\x7fELF"  # the Rust binary, not a Python shim
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert not gpumem.__file__.startswith(here)  # the wheel's, not python/gpumem
    assert any(g["name"] == "h100-80gb-sxm" for g in gpumem.gpus())


CASES = [
    (
        "torchvision:resnet18",
        dict(batch=8, optimizer="adam", strategy="ddp", world_size=2),
        ["--batch", "8", "--optimizer", "adam", "--strategy", "ddp", "--world-size", "2"],
    ),
    (
        "timm:resnet18",
        dict(batch=4, optimizer="sgd", precision="amp-bf16", gpu="h100-80gb-sxm"),
        ["--batch", "4", "--optimizer", "sgd", "--precision", "amp-bf16"]
        + ["--gpu", "h100-80gb-sxm"],
    ),
    (
        f"hf:GPT2LMHeadModel({GPT2})",
        dict(batch=4, seq_len=128, lora=LORA, strategy="fsdp", world_size=2),
        ["--batch", "4", "--seq-len", "128", "--lora", "r=8,alpha=16,targets=c_attn"]
        + ["--strategy", "fsdp", "--world-size", "2", "--optimizer", "adamw"],
    ),
]


@pytest.mark.parametrize("ref,kwargs,flags", CASES, ids=[c[0].split("(")[0] for c in CASES])
def test_estimate_equals_the_command_to_the_byte(ref, kwargs, flags):
    assert gpumem.estimate(ref, **kwargs).to_dict() == command("estimate", ref, *flags)


def live(ref):
    """The model a user would hold for the reference: built on the CPU, weights initialised."""
    if ref.startswith("torchvision:"):
        import torchvision

        return torchvision.models.resnet18()
    if ref.startswith("timm:"):
        import timm

        return timm.create_model("resnet18")
    import transformers

    keys = dict(kv.split("=") for kv in GPT2.split(","))
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**{k: int(v) for k, v in keys.items()})
    )


@pytest.mark.parametrize("ref,kwargs,flags", CASES, ids=[c[0].split("(")[0] for c in CASES])
def test_a_live_model_is_sized_as_its_reference_and_left_untouched(ref, kwargs, flags):
    model = live(ref)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.requires_grad for k, p in model.named_parameters()}
    got = gpumem.estimate(model, **kwargs).to_dict()
    want = gpumem.estimate(ref, **kwargs).to_dict()
    assert got.pop("model").startswith("live:") and want.pop("model") == ref
    assert got == want
    after = model.state_dict()
    assert all(v.device.type == "cpu" and torch.equal(v, before[k]) for k, v in after.items())
    assert {k: p.requires_grad for k, p in model.named_parameters()} == grads


class Mlp(torch.nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, width), torch.nn.Linear(width, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_model_of_ones_own_trains_on_its_example_batch():
    small = gpumem.estimate(Mlp(), batch=64, input=torch.randn(2, 64))
    large = gpumem.estimate(Mlp(), batch=4096, input=torch.randn(2, 64))
    # At the peak, in backward through the ReLU: each sample's 64 inputs, the 256 ReLU outputs
    # kept for backward, and the 2 × 256 gradients flowing back, 4 bytes each.
    grow = lambda part: large.breakdown[part] - small.breakdown[part]
    assert grow("input_batch") == 4032 * 64 * 4
    assert grow("activations") >= 4032 * 256 * 4 and grow("temporaries") >= 4032 * 512 * 4
    assert large.peak - small.peak >= 4032 * (64 + 256 + 512) * 4
    wider = gpumem.estimate(Mlp(4096), batch=64, input=torch.randn(2, 64))
    assert (
        wider.breakdown["parameters"] >= (64 * 4096 + 4096 * 10) * 4 > small.breakdown["parameters"]
    )


def test_max_batch_equals_the_command():
    kwargs = dict(optimizer="adam", gpu="t4")
    got = gpumem.max_batch("torchvision:resnet18", **kwargs)
    want = command("max-batch", "torchvision:resnet18", "--optimizer", "adam", "--gpu", "t4")
    assert got == want["max_batch"] > 0
    at = gpumem.estimate("torchvision:resnet18", batch=got, **kwargs)
    over = gpumem.estimate("torchvision:resnet18", batch=got + 1, **kwargs)
    assert at.upper_bound_fits and not over.upper_bound_fits


def test_plan_equals_the_command():
    mlp = "mlp:input=784,output=10,depth=3,arch=uniform,act=relu"
    got = gpumem.plan(mlp, optimizer="adam", gpu="t4", global_batch=512)
    want = command("plan", mlp, "--optimizer", "adam", "--gpu", "t4", "--global-batch", "512")
    assert got.to_dict() == want and got.best == want["setups"][0]
    spread = dict(gpus=2, strategies=["ddp", "fsdp"], precisions=["amp-bf16"], checkpointing="off")
    got = gpumem.plan("torchvision:resnet18", gpu="a100-40gb", **spread)
    want = command(
        "plan", "torchvision:resnet18", "--optimizer", "adamw", "--gpus", "2xa100-40gb",
        "--strategies", "ddp,fsdp", "--precisions", "amp-bf16", "--checkpointing", "off",
    )  # fmt: skip
    assert got.to_dict() == want
    assert {s["strategy"] for s in got.setups} == {"ddp", "fsdp"}
    with pytest.raises(gpumem.InputError, match="strategies need gpus"):
        gpumem.plan("torchvision:resnet18", strategies=["ddp"])
    with pytest.raises(gpumem.InputError, match="global_batch 3 must be a positive multiple"):
        gpumem.plan("torchvision:resnet18", gpus=2, global_batch=3)
    with pytest.raises(gpumem.InputError, match="tp and the other mesh degrees search FSDP"):
        gpumem.plan("torchvision:resnet18", tp=[2])


def test_the_documented_example_runs(capsys):
    example = os.path.join(
        os.path.dirname(__file__), "..", "..", "docs", "examples", "python-api.py"
    )
    runpy.run_path(example, run_name="__main__")
    out = capsys.readouterr().out
    assert "max batch on a T4:" in out and "InputError: unknown GPU" in out


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x).view(-1, 7)  # 8 does not divide by 7


def test_each_failure_has_its_own_exception():
    with pytest.raises(gpumem.InputError, match="nosuchnet"):
        gpumem.estimate("torchvision:nosuchnet", batch=1)
    with pytest.raises(gpumem.InputError, match="no-such-gpu"):
        gpumem.estimate("torchvision:resnet18", batch=1, gpu="no-such-gpu")
    with pytest.raises(gpumem.InputError, match="optimizer"):
        gpumem.estimate("torchvision:resnet18", batch=1, optimizer="nosuchopt")
    with pytest.raises(gpumem.InputError, match="input="):
        gpumem.estimate(Mlp(), batch=1)  # a model of one's own needs its example batch
    with pytest.raises(gpumem.ModelError, match="test_api.py"):
        gpumem.estimate(Broken(), batch=4, input=torch.randn(4, 8))
    with pytest.raises(gpumem.InputError):
        gpumem.estimate("torchvision:resnet18", batch=0)
    assert issubclass(gpumem.TimeoutError, TimeoutError)
    assert all(
        issubclass(e, gpumem.Error)
        for e in (gpumem.InputError, gpumem.ModelError, gpumem.TimeoutError, gpumem.PythonError)
    )


def test_a_trace_past_its_deadline_raises_timeout(monkeypatch):
    monkeypatch.setenv("GPUMEM_TRACE_TIMEOUT", "1")

    class Slow(Mlp):
        def forward(self, x):
            time.sleep(30)
            return super().forward(x)

    started = time.monotonic()
    with pytest.raises(gpumem.TimeoutError):
        gpumem.estimate(Slow(), batch=2, input=torch.randn(2, 64))
    assert time.monotonic() - started < 25


def test_the_interpreter_lock_is_released_while_a_job_is_sized():
    ticks, done = [0], threading.Event()

    def count():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=count)
    t.start()
    try:
        started = time.monotonic()
        gpumem.estimate("torchvision:resnet18", batch=2)  # traced in a process of its own
        took = time.monotonic() - started
    finally:
        done.set()
        t.join()
    # Held throughout, the counter would not have moved while the trace ran (seconds).
    assert took > 0.5 and ticks[0] > took * 100


# -- gpumem.track: your own step --------------------------------------------------------------

torchvision = pytest.importorskip("torchvision")
F = torch.nn.functional


def own_loop(model, optimizer, x, y, steps=3, scaler=None, second_forward=False):
    """A training loop as people write it: each batch from the loader (here the same one) moved
    to the GPU (rebinding the loop's names frees the last one first)."""
    for xb, yb in [(x, y)] * steps:
        xb, yb = xb.cuda(), yb.to("cuda")
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            if second_forward:
                loss = loss + F.cross_entropy(model(xb), yb)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


@pytest.mark.parametrize("precision", ["fp32", "amp-fp16"])
def test_track_around_ones_own_loop_equals_the_built_in_loop(precision):
    model = torchvision.models.resnet18()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    x, y = torch.randn(16, 3, 224, 224), torch.randint(0, 1000, (16,))
    with gpumem.track(model, opt, gpu="l4") as t:
        scaler = torch.amp.GradScaler("cuda") if precision == "amp-fp16" else None
        own_loop(model, opt, x, y, scaler=scaler)
    got = t.estimate()
    want = gpumem.estimate(
        "torchvision:resnet18", batch=16, optimizer="adamw", precision=precision, gpu="l4"
    )
    assert abs(got.peak / want.peak - 1) <= 0.005, (got, want)
    assert got.breakdown["optimizer_state"] == want.breakdown["optimizer_state"] > 0
    # The model and its optimizer are as they were: its own parameters, on the host, unchanged.
    assert list(model.parameters()) == params and not opt.state
    assert opt.param_groups[0]["params"] == params
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


class Square(torch.autograd.Function):
    """x², keeping 64 copies of its input for backward: what no built-in loop makes."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.repeat(1, 64))
        return x * x

    @staticmethod
    def backward(ctx, g):
        (kept,) = ctx.saved_tensors
        return 2 * g * kept[:, : g.shape[1]]


def test_track_records_what_the_built_in_loop_does_not():
    model = torchvision.models.resnet18()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 3, 224, 224), torch.randint(0, 1000, (16,))
    with gpumem.track(model, opt) as once:
        own_loop(model, opt, x, y)
    with gpumem.track(model, opt) as twice:
        own_loop(model, opt, x, y, second_forward=True)
    # A second forward kept for the same backward: a second copy of the activations.
    more = twice.estimate().breakdown["activations"] - once.estimate().breakdown["activations"]
    assert more > 0.8 * once.estimate().breakdown["activations"]

    mlp = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 10))
    first, second = (
        torch.optim.SGD(mlp[0].parameters(), lr=0.1),
        torch.optim.Adam(mlp[1].parameters()),
    )
    x = torch.randn(256, 512)

    def step(custom):
        with gpumem.track(mlp, [first, second]) as t:
            for _ in range(3):
                h = mlp[0](x.cuda())
                loss = mlp[1](Square.apply(h) if custom else h).mean()
                loss.backward()
                first.step()
                second.step()
                first.zero_grad()
                second.zero_grad()
        return t.estimate()

    plain, custom = step(False), step(True)
    assert plain.breakdown["optimizer_state"] == 2 * (10 * 1024 + 10) * 4  # Adam's, second's only
    assert custom.peak - plain.peak >= 32 << 20  # the function's 64 MiB kept for backward


def test_a_tracked_step_is_a_trace_the_command_sizes(tmp_path):
    model = Mlp()
    opt = torch.optim.Adam(model.parameters())
    with gpumem.track(model, opt, gpu="t4") as t:
        for _ in range(2):
            loss = model(torch.randn(32, 64).cuda()).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    t.save(tmp_path / "step.jsonl")
    assert t.estimate().to_dict() == command(
        "estimate", str(tmp_path / "step.jsonl"), "--gpu", "t4"
    )
    assert t.estimate().to_dict()["batch_size"] == 32


def test_tracked_code_past_its_deadline_raises_timeout(monkeypatch):
    monkeypatch.setenv("GPUMEM_TRACE_TIMEOUT", "1")
    model = Mlp()
    weight = model.a.weight
    with pytest.raises(gpumem.TimeoutError), gpumem.track(model) as t:
        model(torch.randn(4, 64).cuda())
        time.sleep(10)
    assert model.a.weight is weight and weight.device.type == "cpu"
    with pytest.raises(gpumem.InputError, match="nothing recorded"):
        t.estimate()


def test_tracked_code_that_branches_on_a_value_is_stopped_at_its_line():
    model = Mlp()
    with pytest.raises(gpumem.ModelError, match=r"decides a branch.*test_api\.py:\d+"):
        with gpumem.track(model):
            if model(torch.randn(4, 64).cuda()).sum() > 0:
                pass
    assert model.a.weight.device.type == "cpu"
    with gpumem.track(model):  # read, printed, averaged: placeholders, no branch
        out = model(torch.randn(4, 64).cuda())
        labels, loss = out.argmax(1).tolist(), out.mean().item()
        text = f"{loss:.4f} {sum(labels) / len(labels)} {out.detach().numpy().mean()}"
    assert len(labels) == 4 and text == "? ? ?"


# -- gpumem.integrations.hf: the Trainer's callback -------------------------------------------


def tiny_trainer(tmp_path, callback, batch=4):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=256
    )
    data = [{"input_ids": torch.randint(0, 1000, (64,))} for _ in range(16)]
    data = [dict(d, labels=d["input_ids"]) for d in data]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=batch,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
    )
    model = transformers.GPT2LMHeadModel(config)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])


def test_the_trainer_callback_logs_the_estimate_of_the_trainers_job(tmp_path, caplog):
    from gpumem.integrations.hf import GpumemCallback

    callback = GpumemCallback(gpu="t4")
    trainer = tiny_trainer(tmp_path, callback)
    with caplog.at_level("INFO", logger="gpumem"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert repr(callback.estimate) in caplog.text
    # The command, given the Trainer's arguments as a file and the model as a reference (as
    # the Trainer trains it: it turns the model's key/value cache off).
    (tmp_path / "args.json").write_text(trainer.args.to_json_string())
    want = command(
        "estimate", f"hf:GPT2LMHeadModel({GPT2},use_cache=False)", "--batch", "4", "--seq-len", "64",
        "--train-config", str(tmp_path / "args.json"), "--gpu", "t4",
    )  # fmt: skip
    got = callback.estimate.to_dict()
    for d in (got, want):
        d.pop("model")
        d["train_config"].pop("file")
    assert got == want


def small_gpu(tmp_path):
    """A profile of a GPU with 120 MiB beside its CUDA context."""
    small = tmp_path / "small.toml"
    small.write_text(
        '[[gpu]]\nname = "small"\ndisplay = "Small"\ncompute_capability = "8.0"\n'
        "capacity_mib = 520\nsm_count = 8\ntflops = { fp32 = 8.0, tf32 = 8.0, fp16 = 30.0, "
        "bf16 = 30.0 }\nmemory_bandwidth_gbs = 300.0\npower_w = 70.0\nidle_power_w = 10.0\n"
        "cuda_context_mib = 400.0\n"
    )
    return str(small)


def test_the_trainer_callback_stops_a_job_that_does_not_fit_before_its_first_step(tmp_path):
    from gpumem.integrations.hf import GpumemCallback

    small = small_gpu(tmp_path)
    trainer = tiny_trainer(tmp_path, GpumemCallback(profile=str(small), stop_if_over=True), 16)
    with pytest.raises(gpumem.DoesNotFit, match="the largest that fits is") as stopped:
        trainer.train()
    assert trainer.state.global_step == 0
    best = int(str(stopped.value).rsplit(" ", 1)[1])
    job = dict(seq_len=64, profile=str(small), train_config=trainer.args.to_dict())
    assert 0 < best < 16
    assert gpumem.estimate(trainer.model, batch=best, **job).upper_bound_fits
    assert not gpumem.estimate(trainer.model, batch=best + 1, **job).upper_bound_fits


# -- gpumem run: your unmodified script --------------------------------------------------------

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def gpumem_run(*argv, gpu="t4"):
    """`gpumem run --json -- python SCRIPT ARGS…` with this interpreter; its process."""
    exe = os.path.join(os.path.dirname(sys.executable), "gpumem")
    script = [sys.executable, os.path.join(SCRIPTS, argv[0]), *argv[1:]]
    return subprocess.run(
        [exe, "run", "--gpu", gpu, "--json", "--", *script],
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_peak(*argv):
    out = gpumem_run(*argv)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def near(a, b, within=0.01):
    return abs(a / b - 1) <= within


def test_gpumem_run_sizes_an_imagenet_style_script_as_estimate_does():
    got = run_peak("imagenet.py", "-b", "16")
    want = command(
        "estimate",
        "torchvision:resnet18",
        "--batch",
        "16",
        "--optimizer",
        "sgd-momentum",
        "--gpu",
        "t4",
    )
    assert got["batch_size"] == 16
    assert near(got["peak_bytes"], want["peak_bytes"]), (got["peak_mib"], want["peak_mib"])


def test_gpumem_run_sizes_a_hugging_face_trainer_script_as_estimate_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    flags = ["--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "4"]
    flags += ["--max_steps", "10", "--report_to", "none", "--save_strategy", "no"]
    got = run_peak("hf_trainer.py", *flags)
    (args,) = transformers.HfArgumentParser(
        transformers.TrainingArguments
    ).parse_args_into_dataclasses(flags)
    (tmp_path / "args.json").write_text(args.to_json_string())
    want = command(
        "estimate", f"hf:GPT2LMHeadModel({GPT2},use_cache=False)", "--batch", "4", "--seq-len", "64",
        "--train-config", str(tmp_path / "args.json"), "--gpu", "t4",
    )  # fmt: skip
    assert near(got["peak_bytes"], want["peak_bytes"]), (got["peak_mib"], want["peak_mib"])


def test_gpumem_run_sizes_an_mnist_style_script_as_track_does():
    got = run_peak("mnist_cnn.py", "--batch-size", "64")
    mnist = runpy.run_path(os.path.join(SCRIPTS, "mnist_cnn.py"))
    model = mnist["Net"]()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    data = torch.utils.data.TensorDataset(torch.randn(192, 1, 28, 28), torch.randint(0, 10, (192,)))
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    args = type("Args", (), {"log_interval": 1})
    with gpumem.track(model, opt, gpu="t4") as t:
        mnist["train"](args, model, torch.device("cuda"), loader, opt, 1)
    assert got["breakdown_bytes"]["optimizer_state"] > 0  # Adadelta's, as the script makes it
    assert near(got["peak_bytes"], t.estimate().peak)


def test_gpumem_run_sizes_a_script_that_updates_its_weights_by_hand():
    out = gpumem_run("word_lm.py")  # no optimizer: stopped at its third backward pass
    assert out.returncode == 0, out.stderr
    assert "| batch   1 |" in out.stderr and "| batch   2 |" not in out.stderr
    got = json.loads(out.stdout)
    assert got["breakdown_bytes"].get("optimizer_state", 0) == 0
    lm = runpy.run_path(os.path.join(SCRIPTS, "word_lm.py"))
    model = lm["RNNModel"](10000, 200, 200, 2)
    args = type("Args", (), {"batch_size": 20, "bptt": 35, "clip": 0.25, "lr": 20})
    with gpumem.track(model, gpu="t4") as t:
        data = lm["batchify"](torch.randint(0, 10000, (3 * 35 * 20 + 20,)), 20, "cuda")
        lm["train"](model, data, args)
    assert near(got["peak_bytes"], t.estimate().peak)


def test_gpumem_run_stops_where_a_script_branches_on_a_value():
    out = gpumem_run("branches_on_loss.py")
    assert out.returncode != 0
    assert "branches_on_loss.py:13" in out.stderr and "decides a branch" in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.startswith("error:")]) == 1


# -- gpumem.integrations.lightning: Lightning's callback --------------------------------------


def lit_trainer(callback, rows=256, batch=32, width=256):
    L = pytest.importorskip("lightning")

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Mlp(width)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, index):
            (x,) = batch
            loss = self(x).float().mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(rows, 64))
            return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    return trainer, Lit()


def test_the_lightning_callback_logs_the_estimate_of_the_fit(caplog):
    from gpumem.integrations.lightning import GpumemCallback

    callback = GpumemCallback(gpu="t4")
    trainer, module = lit_trainer(callback)
    with caplog.at_level("INFO", logger="gpumem"):
        trainer.fit(module)
    assert trainer.global_step == 2
    assert repr(callback.estimate) in caplog.text
    want = gpumem.estimate(module, batch=32, input=torch.randn(32, 64), optimizer="adamw", gpu="t4")
    assert near(callback.estimate.peak, want.peak, 0.005), (callback.estimate, want)
    assert callback.estimate.breakdown["optimizer_state"] == want.breakdown["optimizer_state"]


def test_the_lightning_callback_stops_a_fit_that_does_not_fit_before_its_first_step(tmp_path):
    from gpumem.integrations.lightning import GpumemCallback, _resized

    callback = GpumemCallback(profile=small_gpu(tmp_path), stop_if_over=True)
    trainer, module = lit_trainer(callback, rows=4096, batch=2048, width=4096)
    with pytest.raises(gpumem.DoesNotFit, match="the largest that fits is") as stopped:
        trainer.fit(module)
    assert trainer.global_step == 0
    best = int(str(stopped.value).rsplit(" ", 1)[1])
    assert 0 < best < 2048
    batch = (torch.randn(2048, 64),)
    assert callback.size(trainer, module, _resized(batch, best)).upper_bound_fits
    assert not callback.size(trainer, module, _resized(batch, best + 1)).upper_bound_fits


def test_gpumem_run_sizes_a_lightning_script_as_the_lightning_callback_does():
    pytest.importorskip("lightning")
    from gpumem.integrations.lightning import GpumemCallback

    got = run_peak("lightning_mlp.py")
    lit = runpy.run_path(os.path.join(SCRIPTS, "lightning_mlp.py"))
    module = lit["LitClassifier"]()
    trainer = type("Fit", (), {"precision": "32-true"})
    trainer.optimizers = [torch.optim.Adam(module.parameters(), lr=1e-3)]
    batch = (torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    want = GpumemCallback(gpu="t4").size(trainer, module, batch)
    assert near(got["peak_bytes"], want.peak), (got["peak_mib"], want)
