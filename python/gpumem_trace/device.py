"""The device a trace runs on (``meta``: shapes without storage), and moving a model onto it as a
move onto a GPU would (used by the loop and by ZeRO's stages 1 and 2)."""

DEVICE = "meta"


def to_device_keeping_ties(model, dtype=None, only=None, device=DEVICE):
    """``model.to(device[, dtype])`` as on a GPU: there a CPU→CUDA move swaps each parameter's
    data in place, so weights tied between modules (GPT-2's lm_head and wte) stay one parameter.
    A move to meta creates new parameters instead, which would untie them; convert each tensor
    once and re-tie. ``dtype`` converts floating-point parameters and buffers (pure bf16/fp16
    training: ``model.to(device, torch.bfloat16)``). ``only(tensor)``, where given, picks the
    tensors moved now; the rest stay where they are. ``device`` is where they go: the trace's,
    or "cuda" where the stand-in CUDA (standin.py) makes that the trace's."""
    owners = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    memo = {}
    # A copy even of a model built on meta: its tensors become the trace's parameters.
    to = lambda t: t.to(
        device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype, copy=True
    )
    move = to if only is None else (lambda t: to(t) if only(t) else t)

    def once(t):  # a tied tensor is met once per owner: copied at the first
        if id(t) not in memo:
            memo[id(t)] = (t, move(t))  # `t` kept alive: its id stays its own
        return memo[id(t)][1]

    model._apply(once)
    for refs in owners.values():
        first = refs[0][0]._parameters[refs[0][1]]
        for m, name in refs[1:]:
            m._parameters[name] = first
    memo.clear()
