"""What "device memory in use" means where: NVML's used (``torch.cuda.device_memory_used``),
``mem_get_info``'s total − free, and nvidia-smi's used and reserved, at three points of a
fine-tune's start (the context, cuBLAS, a bitsandbytes 4-bit layer). One JSON line each.

    python3 scripts/gpu/context_terms.py      (on the GPU machine, bitsandbytes installed)
"""

import json
import subprocess

import torch


def point(name):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    smi = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=memory.used,memory.reserved,memory.total",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    row = {
        "at": name,
        "nvml_used": torch.cuda.device_memory_used(),
        "total_minus_free": total - free,
        "total": total,
        "reserved": torch.cuda.memory_reserved(),
        "nvidia_smi_used_reserved_total_mib": smi,
    }
    print(json.dumps(row), flush=True)


def main():
    import bitsandbytes as bnb

    torch.zeros(1, device="cuda")
    point("torch context")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (a @ a).sum().backward()
    point("bf16 matmul")
    layer = bnb.nn.Linear4bit(
        4096, 4096, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4"
    ).cuda()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    point("Linear4bit")


if __name__ == "__main__":
    main()
