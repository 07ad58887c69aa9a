"""A mixture-of-experts router's stand-in values.

Meta tensors have no values, but an expert-parallel step sizes its buffers by the router's
counts: the tokens each expert gets (``histc``/``bincount`` of the chosen experts' ids) are
exchanged, summed per rank, copied to the host and read (``tolist``) as the all-to-all's
split sizes. A stated stand-in decides them:

- **balanced** (imbalance 1, the estimate): the token-expert choices spread evenly over the
  experts;
- **imbalance F** (the bound): the experts of the traced rank (expert-parallel rank 0 holds
  the first ``E / ep``) get F times their even share, as far as the choices allow — a token
  picks an expert once, so at most ``min(k, E / ep)`` of its ``k`` choices land on one rank —
  and the other experts share the rest evenly. Every rank routes alike, so the traced rank
  receives F times the tokens a balanced router sends it.

The counts' values ride beside the meta tensors (``values``) through the small ops that follow
(views, sums, cumulative sums, casts, the fake group's all-to-all), and come out where the
host reads them: a copy to the host and ``item``. Every other tensor keeps having no values.
"""

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

# Ops whose output a stand-in router count starts: the tokens per expert.
_COUNTS = {aten.histc, aten.bincount}
# A count travels through ops with outputs this small (elements); larger ones are data.
_SMALL = 1 << 16


class Routing:
    """The stand-in values of a trace's router counts (see the module's text).
    ``expert_ranks`` is the expert-parallel degree, ``imbalance`` F ≥ 1."""

    def __init__(self, expert_ranks=1, imbalance=1.0):
        if not (math.isfinite(imbalance) and imbalance >= 1.0):
            raise ValueError(f"routing imbalance {imbalance} is not a number ≥ 1")
        self.expert_ranks = expert_ranks
        self.imbalance = imbalance
        self.values = WeakIdKeyDictionary()

    def counts(self, ids, bins):
        """The stand-in count of each of ``bins`` experts among ``ids``' choices."""
        n = ids.numel()
        local = max(1, bins // self.expert_ranks)  # the traced rank's experts: the first
        if local >= bins:  # no expert parallelism: every expert is the rank's
            return _even(n, bins)
        base = ids._base if ids._base is not None else ids
        top_k = base.shape[-1] if base.dim() == 2 else 1  # (tokens, k) viewed flat
        most = math.floor(n * min(1.0, local / top_k))  # a token picks each expert once
        to_local = min(round(n * local / bins * self.imbalance), most)
        return torch.cat((_even(to_local, local), _even(n - to_local, bins - local)))

    def after(self, func, args, kwargs, out):
        """Attaches stand-in values to ``out`` where ``func`` starts or carries a count."""
        p = func.overloadpacket
        if p in _COUNTS and isinstance(out, torch.Tensor) and out.device.type == "meta":
            bins = args[1] if p is aten.histc and len(args) > 1 else kwargs.get("bins", 100)
            if p is aten.bincount:
                bins = out.numel()
            self.values[out] = self.counts(args[0], bins).to(out.dtype)
            return
        if not self.values or not _small(out):
            return
        if p is torch.ops._c10d_functional.all_to_all_single and args[0] in self.values:
            # Every rank's counts are the traced rank's: from each it receives the chunk meant
            # for it, its own first chunk (equal splits: the counts' exchange).
            from torch.distributed.distributed_c10d import _resolve_process_group

            mine = self.values[args[0]]
            ranks = _resolve_process_group(args[3]).size()
            self.values[out] = mine.view(ranks, -1)[0].repeat(ranks).view(out.shape)
            return
        if p is torch.ops._c10d_functional.wait_tensor:
            # The all-to-all's answer comes wrapped (AsyncCollectiveTensor) until waited on.
            waited = getattr(args[0], "elem", args[0])
            if waited in self.values:
                self.values[out] = self.values[waited]
            return
        has = lambda t: isinstance(t, torch.Tensor) and t in self.values
        known = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
        if not any(has(a) for a in known) or any(
            a.device.type == "meta" and not has(a) for a in known
        ):
            return
        stand_in = lambda t: (
            type(t)(stand_in(x) for x in t)
            if isinstance(t, (tuple, list))
            else self.values[t]
            if has(t)
            else t
        )
        try:
            values = func(
                *[stand_in(a) for a in args], **{k: stand_in(v) for k, v in kwargs.items()}
            )
        except (RuntimeError, TypeError):
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        vals = values if isinstance(values, (tuple, list)) else (values,)
        for o, v in zip(outs, vals):
            if (
                isinstance(o, torch.Tensor)
                and isinstance(v, torch.Tensor)
                and v.device.type == "cpu"
                and o.shape == v.shape
            ):
                self.values[o] = v

    def on_host(self, t, dtype=None):
        """The host copy of ``t`` with its stand-in values, or None where it has none."""
        v = self.values.get(t)
        return None if v is None else v.to(dtype or t.dtype, copy=True)

    def scalar(self, t):
        """``t.item()`` of a count, or None where ``t`` has no stand-in values."""
        v = self.values.get(t)
        return None if v is None else v.item()


def _even(total, parts):
    """``total`` split over ``parts`` as evenly as whole numbers allow, larger parts first."""
    q, r = divmod(int(total), parts)
    return torch.tensor([q + (i < r) for i in range(parts)], dtype=torch.long)


def _flat(args, kwargs):
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from a
        else:
            yield a
    yield from kwargs.values()


def _small(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return all(not isinstance(o, torch.Tensor) or o.numel() <= _SMALL for o in outs)
