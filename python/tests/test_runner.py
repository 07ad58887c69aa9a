"""The workload runner trains each family for a few steps (on the CPU here) and reports JSON."""

import json
import subprocess
import sys

import pytest

from gpumem_trace.run import main, parse_spec


def run(capsys, *argv):
    code = main(list(argv))
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "spec",
    [
        "mlp:input=32,output=4,depth=2,arch=pyramid,act=gelu,dropout=0.2,batchnorm=true,samples=64,summary=true",
        "mlp:input=16,output=1,depth=1,arch=uniform,act=relu,dropout=0,head=sigmoid",
        "cnn:classes=10,filters=8,depth=3,input=16,arch=residual,batchnorm=true,samples=16,summary=true",
        "transformer:vocab=50,embed=16,layers=2,heads=2,ff=32,seq=8,classes=3,samples=16,arch=hybrid",
    ],
)
def test_families_train_on_cpu(capsys, spec):
    code, out = run(capsys, spec, "--batch", "4", "--steps", "2", "--device", "cpu")
    assert code == 0, out
    assert out["status"] == "ok" and out["steps"] == 2, out
    assert out["max_allocated"] == 0 and out["torch"]


def test_spec_parsing():
    fam, kw = parse_spec(
        "cnn:classes=10,filters=8,depth=3,input=16,batchnorm=true,dropout=0.5,arch=dense"
    )
    assert fam == "cnn" and kw == {
        "classes": 10,
        "filters": 8,
        "depth": 3,
        "input": 16,
        "batchnorm": True,
        "dropout": 0.5,
        "arch": "dense",
    }
    with pytest.raises(ValueError):
        parse_spec("resnet:depth=50")


def test_bad_spec_exits_2():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumem_trace.run",
            "resnet:depth=50",
            "--batch",
            "2",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "not a native spec" in r.stderr
