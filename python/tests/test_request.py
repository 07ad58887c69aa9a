"""The tracer's request: gpumem's Rust types (their JSON Schema, request.schema.json, generated
by the Rust side and checked there against the types) and this package's loader must agree, so
that the two sides cannot drift."""

import json
from pathlib import Path

import pytest

from gpumem_trace.__main__ import flags
from gpumem_trace.request import VERSION, from_flags, strategy_options

SCHEMA = json.loads(
    (Path(__file__).parents[1] / "gpumem_trace" / "request.schema.json").read_text()
)


def definition(name):
    return SCHEMA["$defs"][name]


def a_request(*argv):
    return from_flags(flags().parse_args(["hf:gpt2", "--out", "x.jsonl", *argv]))


def test_the_request_a_person_types_is_the_one_gpumem_sends():
    """Every field of gpumem's request, and no other, in the request a person's flags make;
    the same for the options (the job vocabulary)."""
    r = a_request()
    assert set(r) == set(SCHEMA["properties"])
    assert set(r["options"]) == set(definition("OptionValues")["properties"])
    assert r["version"] == VERSION


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--strategy", "ddp", "--world-size", "4", "--gradient-as-bucket-view"],
        [
            "--strategy",
            "fsdp",
            "--world-size",
            "8",
            "--replicas",
            "2",
            "--fsdp-param-dtype",
            "bf16",
        ],
        ["--strategy", "zero3", "--world-size", "8", "--zero", '{"offload_param": true}'],
        ["--strategy", "fsdp", "--world-size", "8", "--tp", "2", "--no-sequence-parallel"],
        ["--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--lora-quant", "nf4"],
        ["--selective", "--precision", "amp-bf16", "--seq-len", "128", "--sdpa", "flash"],
    ],
)
def test_requests_validate_against_the_schema(argv):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(a_request(*argv), SCHEMA)


def test_every_strategy_setting_the_schema_names_is_read():
    """The loader reads each of a strategy's settings the schema states (the older spelling,
    world_size and replicas, is gpumem's to read; it never sends it; routing_imbalance is the
    bound's, which gpumem traces apart: the request's own routing_imbalance says which trace
    this is)."""
    stated = set(definition("StrategyValues")["properties"]) - {
        "world_size",
        "replicas",
        "kind",
        "routing_imbalance",
    }
    strategies = [
        {"kind": "ddp", "mesh": {"replicate": 4}, "bucket_cap_mb": 25, "bucket_view": True},
        {
            "kind": "fsdp",
            "mesh": {"replicate": 2, "shard": 4},
            "reshard_after_forward": False,
            "param_dtype": "bf16",
            "cpu_offload": True,
            "sync_each_batch": True,
        },
        {"kind": "zero", "mesh": {"shard": 8}, "stage": 2, "zero": {"offload_optimizer": True}},
        {
            "kind": "fsdp",
            "mesh": {"shard": 2, "tensor": 2, "pipeline": 4},
            "schedule": "interleaved-1f1b",
            "microbatches": 8,
            "virtual_stages": 2,
        },
        {"kind": "fsdp", "mesh": {"shard": 8, "tensor": 2, "expert": 4}},
        {"kind": "fsdp", "mesh": {"shard": 4, "tensor": 2}, "sequence_parallel": False},
    ]
    assert set().union(*(set(s) - {"kind"} for s in strategies)) == stated
    fsdp = strategy_options(strategies[1])
    assert (fsdp["world_size"], fsdp["replicas"], fsdp["reshard_after_forward"]) == (8, 2, False)
    assert fsdp["sync_each_batch"] and not strategy_options(strategies[3])["sync_each_batch"]
    pp = strategy_options(strategies[3])
    assert (pp["world_size"], pp["tensor"], pp["pipeline"]) == (16, 2, 4)
    assert (pp["schedule"], pp["microbatches"], pp["virtual_stages"]) == ("interleaved-1f1b", 8, 2)
    # Expert parallelism borrows its ranks: 16 GPUs, experts over 4 of them.
    ep = strategy_options(strategies[4])
    assert (ep["world_size"], ep["tensor"], ep["expert"]) == (16, 2, 4)
    assert set(definition("Zero")["properties"]) >= set(strategies[2]["zero"])
    assert not strategy_options(strategies[5])["sequence_parallel"]
    assert strategy_options(strategies[4])["sequence_parallel"]
