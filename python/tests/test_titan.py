"""torchtitan's activation checkpointing, held to torchtitan's own code (python/gpumem_trace/ac.py).

These need torchtitan (0.2.2, with torch 2.10.0: scripts/test.sh makes that environment). Where
it is not installed they are skipped with the reason, unless GPUMEM_TEST_REQUIRE_TITAN=1 (CI),
where its absence fails them.

On torchtitan's small Llama (flavor debugmodel), torchtitan's own ``apply_ac`` is run on its own
model with ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` spied on: each policy
decision is recorded op by op, beside what gpumem's restatement decides for the same call, and
the SAC context's storage (the tensors torchtitan's policy keeps for backward) is read after the
forward. gpumem's trace of the same model and mode must then keep for backward, block by block,
exactly those tensors: the same ops' outputs, the same bytes."""

import copy
import importlib
import json
import re
from collections import Counter

import pytest
import torch
from test_tracer import live_and_peak, run
from trainers import requires

from gpumem_trace import ac, cuda
from gpumem_trace.loop import TraceOptions, trace_training
from gpumem_trace.sdpa import Stack

REF = "torchtitan:llama3(flavor=debugmodel)"
SEQ, BATCH = 128, 2

pytestmark = requires("torchtitan")

MODES = {"full": ("full", "2"), "selective-op": ("selective", "op")}
MODES["selective-layer:2"] = ("selective", "2")


def _storages(tree):
    """The distinct storages of the tensors in a SAC storage entry (its _VersionWrapper's)."""
    out = {}

    def visit(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif hasattr(x, "val"):
            visit(x.val)
        elif isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            out[(s.data_ptr(), id(s))] = s.nbytes()

    visit(tree)
    return out


def titan_reference(mode, monkeypatch):
    """torchtitan's own model and ``apply_ac`` for ``mode``, forward and backward on the meta
    device under CUDA's kernel choices. Returns (wrapped block indices, per SAC context: its
    decisions [(is_recompute, op, torchtitan's, gpumem's restatement's)] and the bytes its
    forward kept, by op name)."""
    import torch.utils.checkpoint as ckpt
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed import activation_checkpoint as titan_ac
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    contexts = []
    real = ckpt.create_selective_checkpoint_contexts

    def spy(policy_fn, *a, **k):
        ours = ac.titan_op_policy()()
        record = []

        def both(ctx, func, *args, **kwargs):
            theirs = policy_fn(ctx, func, *args, **kwargs)
            record.append((ctx.is_recompute, func, theirs, ours(ctx, func, *args, **kwargs)))
            return theirs

        fwd, rec = real(both, *a, **k)
        contexts.append((record, fwd))
        return fwd, rec

    monkeypatch.setattr(ckpt, "create_selective_checkpoint_contexts", spy)
    args = copy.deepcopy(llama3_args["debugmodel"])
    args.max_seq_len = SEQ
    with torch.device("meta"):
        model = Transformer(args)
    model.train()
    titan_mode, option = MODES[mode]
    titan_ac._layer_sac_count = 0
    titan_ac.apply_ac(
        model,
        ActivationCheckpoint(mode=titan_mode, selective_ac_option=option),
        op_sac_save_list=_op_sac_save_list,
    )
    wrapped = {int(i) for i, b in model.layers.named_children() if isinstance(b, CheckpointWrapper)}
    tokens = torch.zeros((BATCH, SEQ), dtype=torch.long, device="meta")
    kept = []
    with cuda.patches(Stack.here("8.0", None)):
        pred = model(tokens)
        for _, fwd in contexts:
            by_op = Counter()
            for func, outs in fwd.storage.items():
                for s in outs:
                    by_op[str(func.__name__).split(".")[0]] += sum(_storages(s).values())
            kept.append(by_op)
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), tokens.flatten())
        del pred
        loss.backward()
    return wrapped, [(record, k) for (record, _), k in zip(contexts, kept)]


def gpumem_kept(mode, tmp_path, restated=False, monkeypatch=None):
    """gpumem's trace of the same model and mode: per block, the forward's allocations still
    alive when backward starts (the block's output, the next block's input, left out), as
    (op of each saved call in order, bytes by op)."""
    if restated:
        monkeypatch.setattr(ac, "titan_module", lambda: None)
    out = tmp_path / f"{mode}.jsonl"
    trace_training(
        TraceOptions(model=REF, batch=BATCH, seq_len=SEQ, checkpointing=mode, iterations=1), out
    )
    events = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    live = {}
    for e in events:
        if e["ev"] == "alloc":
            if e["phase"] == "backward":
                break
            live[e["id"]] = e
        elif e["ev"] == "free":
            live.pop(e["id"], None)
    blocks = {}
    for e in live.values():
        m = re.match(
            r"layers\.(\d+)((?:\._checkpoint_wrapped_module)?)(\..*)?$", e.get("module") or ""
        )
        if m and e["phase"] == "forward":
            blocks.setdefault(int(m.group(1)), []).append(e)
    kept = {}
    for i, allocs in blocks.items():
        # The block's output: its last allocation, at the block's own level (the residual add).
        last = allocs[-1]
        assert last["op"] == "add" and not re.search(
            r"\.(attention|feed_forward|\w+_norm)", last["module"]
        )
        calls, by_op, prev = [], Counter(), None
        for e in allocs[:-1]:
            if (e["module"], e["op"]) != prev:
                calls.append(e["op"])
            prev = (e["module"], e["op"])
            by_op[e["op"]] += e["bytes"]
        kept[i] = (calls, by_op)
    return kept


def test_the_restatement_decides_as_torchtitan_does_op_by_op(monkeypatch):
    """gpumem's restatement of torchtitan 0.2.2's op policy decides every call of a forward
    and of the recomputation as torchtitan's own policy does; and its layer rule wraps the
    blocks torchtitan's ``_apply_layer_sac`` wraps, for every frequency."""
    _, contexts = titan_reference("selective-op", monkeypatch)
    assert len(contexts) == 6  # one per block, its forward's and its recomputation's calls
    decisions = [d for record, _ in contexts for d in record]
    assert len(decisions) > 100
    for is_recompute, func, theirs, ours in decisions:
        assert theirs == ours, (is_recompute, func, theirs, ours)
    # The rule the restatement states: of each block's seven matmuls, the odd-numbered saved.
    from torch.utils.checkpoint import CheckpointPolicy

    for record, _ in contexts:
        for recompute in (False, True):
            mms = [t for r, f, t, _ in record if f == torch.ops.aten.mm.default and r == recompute]
            assert mms == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 3 + [
                CheckpointPolicy.MUST_SAVE
            ]

    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed import activation_checkpoint as titan_ac

    for every in range(1, 5):
        titan_ac._layer_sac_count = 0
        config = ActivationCheckpoint(mode="selective", selective_ac_option=str(every))
        theirs = [titan_ac._apply_layer_sac(torch.nn.Linear(1, 1), config) for _ in range(6)]
        wrapped = [not isinstance(w, torch.nn.Linear) for w in theirs]
        assert wrapped == [ac.titan_layer_wrapped(i, every) for i in range(6)], every


def test_the_installed_torchtitan_is_the_one_restated():
    assert importlib.import_module("torchtitan").__version__ == ac.TITAN_RELEASE
    assert ac.titan_module() is not None
    assert (
        ac.titan_save_ops()
        == importlib.import_module("torchtitan.models.llama3.infra.parallelize")._op_sac_save_list
    )


@pytest.mark.parametrize("mode", ["full", "selective-op", "selective-layer:2"])
@pytest.mark.parametrize("restated", [False, True], ids=["torchtitan's code", "restatement"])
def test_gpumem_keeps_for_backward_what_torchtitans_policy_keeps(
    mode, restated, tmp_path, monkeypatch
):
    """Block by block, the tensors gpumem's trace keeps from the forward to the backward are
    those torchtitan's own policy keeps: under selective-op its saved calls in order and
    their bytes; under full and selective-layer:2 nothing in the blocks torchtitan wraps, and
    in the others what autograd saves (more than nothing)."""
    wrapped, contexts = titan_reference(mode, monkeypatch)
    monkeypatch.undo()
    kept = gpumem_kept(mode, tmp_path, restated, monkeypatch)
    assert sorted(kept) == list(range(6))
    if mode == "selective-op":
        assert wrapped == set(range(6))
        assert len(contexts) == 6
        from torch.utils.checkpoint import CheckpointPolicy

        for i, (record, by_op) in enumerate(contexts):
            saved = [
                f.__name__.split(".")[0]
                for r, f, t, _ in record
                if t == CheckpointPolicy.MUST_SAVE and not r
            ]
            calls, bytes_by_op = kept[i]
            assert calls == saved, (i, calls, saved)
            assert bytes_by_op == by_op, (i, bytes_by_op, by_op)
            assert saved.count("mm") == 4
    else:
        assert wrapped == ({1, 3, 5} if mode == "selective-layer:2" else set(range(6)))
        assert {i for i in range(6) if not kept.get(i, ([], {}))[0]} == wrapped


def test_the_estimate_moves_with_selective_ac_option_by_the_saved_bytes(tmp_path):
    """What a torchtitan job holds when backward starts changes with ``selective_ac_option``
    (op against every second layer against full) by exactly the bytes the kept tensors differ."""
    live, kept = {}, {}
    for mode in ["full", "selective-op", "selective-layer:2"]:
        out = tmp_path / f"{mode}.jsonl"
        trace_training(
            TraceOptions(model=REF, batch=BATCH, seq_len=SEQ, checkpointing=mode, iterations=1), out
        )
        events = [json.loads(line) for line in out.read_text().splitlines()[1:]]
        alive = {}
        for e in events:
            if e["ev"] == "alloc":
                if e["phase"] == "backward":
                    break
                alive[e["id"]] = e["bytes"]
            elif e["ev"] == "free":
                alive.pop(e["id"], None)
        live[mode] = sum(alive.values())
        kept[mode] = sum(sum(b.values()) for _, b in gpumem_kept(mode, tmp_path).values())
    assert live["full"] < live["selective-op"] and live["full"] < live["selective-layer:2"]
    assert live["selective-op"] != live["selective-layer:2"]
    for a, b in [
        ("selective-op", "full"),
        ("selective-layer:2", "full"),
        ("selective-op", "selective-layer:2"),
    ]:
        assert live[a] - live[b] == kept[a] - kept[b], (a, b, live, kept)


def _traced(tmp_path, ref, *flags):
    """The header and events of the tracer run as a person runs it on ``ref`` (batch 2)."""
    p, events = run([ref, "--batch", "2", *flags], tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    return events[0], events[1:]


def test_compile_compiles_torchtitans_own_loss(tmp_path):
    """``--compile`` on a torchtitan model: torchtitan's own ``build_loss_fn`` compiles its
    cross-entropy (``compile.components`` naming the loss), and the compiled loss keeps no fp32
    log-probabilities: the trace's peak falls by those of the whole batch."""
    _, eager = _traced(tmp_path, REF, "--seq-len", "256")
    header, compiled = _traced(tmp_path, REF, "--seq-len", "256", "--compile")
    assert header["options"]["compile"] is True
    made = lambda events, op: [e for e in events if e["ev"] == "alloc" and e["op"] == op]
    fp32 = made(eager, "_log_softmax")
    assert fp32 and not made(compiled, "_log_softmax") and made(compiled, "amax")
    # Less what the compiled loss keeps instead: a few fp32 values per token (2 x 256 tokens).
    saved = live_and_peak(eager)[1] - live_and_peak(compiled)[1]
    assert saved >= fp32[0]["bytes"] - 3 * 512 * 4


def test_tensor_parallel_is_torchtitans_own_apply_tp(tmp_path):
    """``--tp`` on a torchtitan model runs torchtitan's own ``apply_tp`` (its plan, sequence
    parallelism, loss parallelism: the step runs under ``loss_parallel()``): a TP=2 rank holds
    half of every sharded weight and of Adam's states on them, the norms whole, and — as with
    Hugging Face models — the embedding's gradient whole (DTensor's); FSDP2 over 2 shards it
    again."""

    def held(*extra):
        header, events = _traced(tmp_path, REF, "--seq-len", "64", *extra)
        sizes, live = {}, Counter()
        for e in events:
            if e["ev"] == "alloc":
                sizes[e["id"]] = (e["bytes"], e["category"])
            elif e["ev"] == "free":
                del sizes[e["id"]]
        for nbytes, category in sizes.values():
            live[category] += nbytes
        return header, live

    header, single = held()
    model = importlib.import_module("gpumem_trace.models").resolve(REF, seq_len=64).model
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    embedding = model.tok_embeddings.weight.numel()
    sharded = header["parameters"] - norms
    buffers = single["parameter"] - 4 * header["parameters"]  # freqs_cis
    _, rank = held("--tp", "2")
    share = sharded // 2 + norms
    assert rank["parameter"] == 4 * share + buffers, rank
    assert rank["optimizer_state"] == 8 * share, rank
    assert rank["gradient"] == 4 * (share + embedding // 2), rank
    _, rank = held("--strategy", "fsdp", "--world-size", "4", "--tp", "2")
    share = sharded // 4 + norms // 2
    assert (rank["parameter"], rank["optimizer_state"]) == (4 * share, 8 * share), rank


def test_sharding_propagation_allocates_nothing(tmp_path):
    """DTensor learns an op's output layout by running it once on fake tensors of the global
    shape (its sharding propagation, cached afterwards): nothing a GPU allocates. With loss
    parallelism the logits' gradient is cast back to bf16 in backward — on the rank, its share
    of the vocabulary; the global tensor is the propagation's."""
    _, events = _traced(
        tmp_path,
        REF,
        *("--seq-len", "64", "--strategy", "fsdp", "--world-size", "4", "--tp", "2"),
        *("--fsdp-param-dtype", "bf16", "--checkpointing", "full"),
    )
    model = importlib.import_module("gpumem_trace.models").resolve(REF, seq_len=64).model
    share = 2 * 64 * model.model_args.vocab_size // 2 * 2  # the rank's bf16 logits
    casts = Counter(
        e["bytes"]
        for e in events
        if e["ev"] == "alloc" and e["phase"] == "backward" and e["op"] == "_to_copy"
    )
    assert casts and max(casts) == share, casts


def _received(events, layer):
    """The largest all-to-all answer in a MoE layer's experts in forward: the tokens the traced
    rank's experts received (bytes)."""
    return max(
        e["bytes"]
        for e in events
        if e["ev"] == "alloc"
        and e["op"] == "all_to_all_single"
        and e.get("module") == f"layers.{layer}.moe.experts"
        and e["phase"] == "forward"
    )


def test_expert_parallel_rank_receives_its_experts_tokens_and_the_bound_grows_with_imbalance(
    tmp_path,
):
    """``--ep`` runs torchtitan's own ``apply_moe_ep_tp`` (``ExpertParallel``: experts split
    over the ranks, tokens dispatched by all-to-all) and its FSDP wrapping. The router's
    stand-in decides the all-to-all's sizes: balanced, a rank receives as many token-expert
    choices as its ranks route (2 × 64 tokens × top-3); at imbalance F its experts get F times
    that, up to the most top-k routing allows (each token picks an expert once: at most 2 of
    its 3 choices land on a rank of 2 experts, 8/3 of the even share with 4 ranks). The same
    on a Mixtral-shaped router."""
    ref = "torchtitan:deepseek_v3(flavor=debugmodel)"
    flags = ("--seq-len", "64", "--gpu-capability", "9.0", "--strategy", "fsdp")
    flags += ("--world-size", "4", "--ep", "4")
    row = 256 * 4  # dim, fp32
    received = {}
    for f in ("1", "2", "4"):
        _, events = _traced(tmp_path, ref, *flags, "--routing-imbalance", f)
        received[f] = _received(events, 1)
    assert received["1"] == 2 * 64 * 3 * row, received
    assert received["2"] == 2 * received["1"], received
    assert received["4"] == 2 * 64 * 3 * row * 8 // 3, received
    # Mixtral's routing (8 experts, top-2, no shared one) over 8 ranks: a rank's one expert
    # can take one of each token's two choices, four times the even share at most.
    mixtral = (
        "torchtitan:qwen3(flavor=debugmodel_moe,moe_args.num_experts=8,moe_args.top_k=2,"
        "moe_args.num_shared_experts=0)"
    )
    flags = flags[:-4] + ("--world-size", "8", "--ep", "8")
    received = {}
    for f in ("1", "2", "8"):
        _, events = _traced(tmp_path, mixtral, *flags, "--routing-imbalance", f)
        received[f] = _received(events, 1)
    assert received["1"] == 2 * 64 * 2 * row, received
    assert (received["2"], received["8"]) == (2 * received["1"], 4 * received["1"]), received


def test_expert_parallel_rank_gathers_its_share_of_the_experts(tmp_path):
    """An EP=N rank holds E/N of each MoE layer's experts: FSDP (over the ranks EP leaves,
    torchtitan's ``efsdp``) all-gathers each expert weight at 1/N of the whole one a rank of
    FSDP alone gathers (Qwen3-MoE's debug shape: 64 experts of 768 × 256, fp32)."""
    ref = "torchtitan:qwen3(flavor=debugmodel_moe)"
    flags = ("--seq-len", "32", "--gpu-capability", "9.0", "--strategy", "fsdp")
    whole = 64 * 768 * 256 * 4

    def expert_gathers(*extra):
        _, events = _traced(tmp_path, ref, *flags, "--world-size", "4", *extra)
        return {
            e["bytes"]
            for e in events
            if e["ev"] == "alloc" and e["op"] == "fsdp_all_gather" and e["bytes"] >= whole // 8
        }

    assert expert_gathers() == {whole}
    assert expert_gathers("--ep", "2") == {whole // 2}


def _live_at_backward(events):
    """Bytes live per category when the second iteration's backward first allocates."""
    live, iteration = {}, 0
    for e in events:
        iteration += e["ev"] == "iteration"
        if e["ev"] == "alloc":
            if e["phase"] == "backward" and iteration >= 2:
                break
            live[e["id"]] = (e["bytes"], e["category"])
        elif e["ev"] == "free":
            live.pop(e["id"], None)
    held = Counter()
    for nbytes, category in live.values():
        held[category] += nbytes
    return held


def test_context_parallel_rank_holds_its_chunks_and_gathers_the_keys_and_values(tmp_path):
    """``--cp N`` runs torchtitan's own ``apply_cp_to_attention_module`` and cuts each batch
    to the rank's chunks (``prepare_context_parallel_input``); FSDP shards over the CP ranks.
    At the end of forward a CP=N rank over S tokens holds what one GPU holds over S/N (its
    chunks' activations) plus at most one fp32 copy of each layer's attention output (ring
    attention merges its chunks' outputs in fp32), and 1/N of the optimizer state; each
    layer's forward all-gathers the whole sequence's keys and values (PyTorch's default
    rotation), a buffer a formula of the chunks alone would miss."""
    flags = ("--gpu-capability", "9.0", "--precision", "amp-bf16")
    layers, dim, batch = 6, 256, 2  # llama3 debugmodel, no GQA
    whole_header, whole = _traced(tmp_path, REF, *flags, "--seq-len", "1024")
    whole = _live_at_backward(whole)
    for n in (2, 4):
        _, chunked = _traced(tmp_path, REF, *flags, "--seq-len", str(1024 // n))
        chunked = _live_at_backward(chunked)
        _, events = _traced(tmp_path, REF, *flags, "--seq-len", "1024", "--cp", str(n))
        rank = _live_at_backward(events)
        extra = rank["activation"] - chunked["activation"]
        assert 0 < extra <= layers * batch * (1024 // n) * dim * 4, (n, extra)
        assert rank["optimizer_state"] * n == whole["optimizer_state"], (n, rank)
        gathers = [
            e["bytes"]
            for e in events
            if e["ev"] == "alloc"
            and e["op"] == "all_gather_into_tensor"
            and e["phase"] == "forward"
            and e.get("module", "").endswith("attention.inner_attention")
        ]
        assert set(gathers) == {2 * batch * 1024 * dim * 2}, (n, set(gathers))
        assert len(gathers) == layers * whole_header["iterations"], (n, len(gathers))


def test_pipeline_stage_of_a_torchtitan_model_holds_its_model_part(tmp_path):
    """``--pp`` on a torchtitan model cuts it as torchtitan does (its own
    ``generate_llm_fqn_per_model_part``: the embedding and the norm with the head each weigh as a
    layer), each part a copy of the model keeping its modules: stage k's rank holds exactly its
    part's parameters (and Adam's two states on them), and every stage runs under the schedule."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    model = importlib.import_module("gpumem_trace.models").resolve(REF, seq_len=64).model
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    parts = generate_llm_fqn_per_model_part(4, len(model.layers), 1, 1)
    for k, names in enumerate(parts):
        held = sum(n for p, n in sizes.items() if any(p.startswith(m + ".") for m in names))
        _, events = _traced(
            tmp_path, REF, "--seq-len", "64", "--batch", "4", "--pp", "4", "--pp-rank", str(k)
        )
        live, sizes_by_id = Counter(), {}
        for e in events:
            if e["ev"] == "alloc":
                sizes_by_id[e["id"]] = (e["bytes"], e["category"])
            elif e["ev"] == "free":
                del sizes_by_id[e["id"]]
        for nbytes, category in sizes_by_id.values():
            live[category] += nbytes
        assert live["optimizer_state"] == 8 * held, (k, names, live)
        assert live["parameter"] >= 4 * held, (k, names, live)


def test_tensor_and_pipeline_parallel_rank_holds_its_share_of_its_part(tmp_path):
    """``--tp 2 --pp 2`` on a torchtitan model: torchtitan's cut, then its ``apply_tp`` on each
    part — stage k's rank holds half of each sharded weight of its part (and Adam's two states
    on them), its norms whole; what crosses between the stages is each tensor rank's half of
    the sequence."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    model = importlib.import_module("gpumem_trace.models").resolve(REF, seq_len=64).model
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    parts = generate_llm_fqn_per_model_part(2, len(model.layers), 1, 1)
    for k, names in enumerate(parts):
        mine = {p: n for p, n in sizes.items() if any(p.startswith(m + ".") for m in names)}
        share = sum(n if "norm" in p else n // 2 for p, n in mine.items())
        _, events = _traced(
            tmp_path,
            REF,
            *("--seq-len", "64", "--batch", "4", "--strategy", "fsdp", "--world-size", "4"),
            *("--tp", "2", "--pp", "2", "--pp-rank", str(k), "--microbatches", "2"),
        )
        live, sizes_by_id = Counter(), {}
        for e in events:
            if e["ev"] == "alloc":
                sizes_by_id[e["id"]] = (e["bytes"], e["category"])
            elif e["ev"] == "free":
                del sizes_by_id[e["id"]]
        for nbytes, category in sizes_by_id.values():
            live[category] += nbytes
        assert live["optimizer_state"] == 8 * share, (k, names, live)
        if k == 1:  # kept: stage 0's activations received, 2 micro-batches × 2 × 32 tokens in fp32
            kept = [b for b, c in sizes_by_id.values() if c == "activation"]
            assert kept == [2 * 32 * model.model_args.dim * 4] * 2, kept
