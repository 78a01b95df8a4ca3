"""``optimizer._name=adam_fused``: fairseq's ``adam`` computed by PyTorch's fused AdamW kernel.

fairseq's ``adam`` uses apex's FusedAdam when apex is installed and a GPU is present, and
otherwise its own ``Adam``: a Python loop of about ten kernels per parameter tensor. Under
``common.fp16`` fairseq flattens the fp32 master weights into one tensor, so that loop runs
once; under ``common.bf16`` (never flattened) and fp32 it runs once per tensor (about 200 in a
12-layer model), and fairseq's gradient norm adds one more kernel per tensor.

This optimizer takes the same settings (``adam_betas``, ``adam_eps``, ``weight_decay``) and
makes the same update as fairseq's ``adam``:

- weight decay decoupled, AdamW-style: ``p -= lr * weight_decay * p`` before the Adam step;
- eps added to the uncorrected root, ``lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``.
  PyTorch adds eps after the bias correction, so each step passes it ``eps / sqrt(1 - b2^t)``,
  which makes the two updates equal.

It works on the fp32 master weights of fairseq's FP16Optimizer (flat under fp16, per tensor
under bf16) and on fp32 models; it refuses ``common.memory_efficient_fp16`` /
``memory_efficient_bf16`` (those step half-precision weights, which PyTorch's AdamW would keep
in half-precision state). ``adam_fused_impl``: ``fused`` (one multi-tensor kernel, CUDA and
CPU) or ``foreach`` (a few kernels per group).
"""

import math
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II, OmegaConf

IMPLEMENTATIONS = ChoiceEnum(["fused", "foreach"])


@dataclass
class FairseqFusedAdamConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for Adam optimizer"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer (fairseq's adam's placement)"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled (AdamW) weight decay, as fairseq's adam"})
    adam_fused_impl: IMPLEMENTATIONS = field(
        default="fused", metadata={"help": "fused: one kernel for all tensors; foreach: a few per group"}
    )
    lr: list[float] = II("optimization.lr")


class FairseqEpsAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose eps sits where fairseq's Adam puts it (see the module's doc).

    fairseq's Adam counts steps per parameter: one that had no gradient on a step (fp32 training
    of an unused or frozen-then-unfrozen head) is not stepped and its count stays behind. PyTorch
    also counts per parameter, but its count lives on the GPU under ``fused``, and reading it would
    wait for the GPU every step; so each parameter's count is kept again in Python, in its state
    (``fairseq_step``, saved with the checkpoint). The eps of a step depends on that count, and
    PyTorch takes one eps per group: each step hands PyTorch the group split by count (one part,
    and so one kernel, unless parameters missed steps).
    """

    supports_memory_efficient_fp16 = False
    supports_flat_params = True  # pointwise: one flat tensor or many give the same update

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # before the split: it makes the gradients the split looks at
            with torch.enable_grad():
                loss = closure()
        groups, counts, parts = self.param_groups, {}, []
        for group in groups:
            by_count = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:  # PyTorch, like fairseq, skips (and does not count) the others
                    counts[p] = self.state[p].get("fairseq_step", 0) + 1
                    by_count[counts[p]].append(p)
            for t, params in by_count.items():
                parts.append({**group, "params": params, "eps": group["eps"] / math.sqrt(1 - group["betas"][1] ** t)})
        self.param_groups = parts
        try:
            super().step()
        finally:
            self.param_groups = groups
        for p, t in counts.items():  # after the step: PyTorch initialises a parameter's state if it is empty
            self.state[p]["fairseq_step"] = t
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # Each parameter's count is PyTorch's own (``step``, read once here). That also converts the
        # checkpoints of the earlier adam_fused, which kept one count per group (``fairseq_step`` in
        # the param group, ahead of PyTorch's per-parameter count for a parameter that missed steps).
        for group in self.param_groups:
            group.pop("fairseq_step", None)
            for p in group["params"]:
                if "step" in self.state.get(p, {}):
                    self.state[p]["fairseq_step"] = int(self.state[p]["step"])


@register_optimizer("adam_fused", dataclass=FairseqFusedAdamConfig)
class FairseqFusedAdam(FairseqOptimizer):
    """fairseq's adam (AdamW-style weight decay, its eps) in torch's fused or foreach AdamW."""

    def __init__(self, cfg: FairseqFusedAdamConfig, params):
        super().__init__(cfg)
        impl = str(cfg.adam_fused_impl)
        self._optimizer = FairseqEpsAdamW(
            params, fused=impl == "fused", foreach=impl == "foreach", **self.optimizer_config
        )

    @property
    def optimizer_config(self):
        lr = self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr
        betas = self.cfg.adam_betas
        betas = eval(betas) if isinstance(betas, str) else OmegaConf.to_container(betas)  # "(0.9,0.98)", as adam's
        return {"lr": lr, "betas": tuple(betas), "eps": self.cfg.adam_eps, "weight_decay": self.cfg.weight_decay}

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """fairseq.utils.clip_grad_norm_ with one multi-tensor norm instead of one kernel per tensor."""
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads], 2)
        total_norm = torch.linalg.vector_norm(torch.stack(norms))
        if aggregate_norm_fn is not None:
            total_norm = aggregate_norm_fn(total_norm)
        if max_norm > 0:
            clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp_(max=1)
            torch._foreach_mul_(grads, clip_coef)
        return total_norm
