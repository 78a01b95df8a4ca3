"""A linear probe of a frozen model's features, and a classification head that computes it.

LP-FT (Kumar et al. 2022, "Fine-Tuning can Distort Pretrained Features"): a finetuning that starts
from a random head spends its first updates pushing large, random gradients into the encoder; one
that starts from the head a linear probe fits changes the features less and keeps what they know.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

PENALTIES = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
# fairseq's head applies tanh to its dense layer; at this slope tanh(a z) / a stays within 1.3% of z
# for standardized features |z| <= 4, so the head computes the probe's logits almost exactly and
# finetuning starts in tanh's linear range, where the head's gradients are undamped
TANH_SLOPE = 0.05
ACTIVATIONS = ("tanh", "linear")  # the head activations under which a head can compute a linear probe
# A feature whose spread across documents is under this share of the median feature's is scaled as if
# it had that spread. all-MiniLM-L6-v2's final states have three dimensions of spread 1e-7 (against
# 0.05): standardized by it, their rounding noise became features the probe weighed, and the head's
# dense layer multiplied them by 1e5-1e6, so finetuning's first updates swung the logits (gradient norms
# of 1e3-1e4) and undid the probe.
MIN_RELATIVE_SCALE = 1e-2


class Probe(NamedTuple):
    """Logistic regression on standardized features: logits = ((x - mean) / scale) @ weight + bias."""

    penalty: float
    valid: float  # accuracy on the validation split, 0..1
    weight: torch.Tensor  # C x classes
    bias: torch.Tensor  # classes
    mean: torch.Tensor  # C
    scale: torch.Tensor  # C

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return ((features.double() - self.mean) / self.scale) @ self.weight + self.bias


def fit_linear_probe(features, labels, penalties=PENALTIES) -> Probe:
    """Logistic regression (L-BFGS, float64) on features standardized by the training split's
    statistics, once per L2 penalty (times the squared weights, beside the mean loss); the one
    best on the validation split is kept. features, labels: ``N x C`` and ``N`` (class indices)
    of the splits ``train`` and ``valid``."""
    mean = features["train"].double().mean(0)
    spread = features["train"].double().std(0)
    scale = spread.clamp(min=MIN_RELATIVE_SCALE * spread.median().item() + 1e-12)
    x = {split: (features[split].double() - mean) / scale for split in ("train", "valid")}
    classes = int(labels["train"].max()) + 1
    best = None
    for penalty in penalties:
        weight = torch.zeros(x["train"].size(1), classes, dtype=torch.float64, requires_grad=True)
        bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
        solver = torch.optim.LBFGS([weight, bias], max_iter=1000, line_search_fn="strong_wolfe")

        def loss():
            solver.zero_grad()
            value = F.cross_entropy(x["train"] @ weight + bias, labels["train"]) + penalty * weight.square().sum()
            value.backward()
            return value

        solver.step(loss)
        with torch.no_grad():
            valid = (x["valid"] @ weight + bias).argmax(1).eq(labels["valid"]).double().mean().item()
        if best is None or valid > best.valid:
            best = Probe(penalty, valid, weight.detach(), bias.detach(), mean, scale)
    return best


def head_weights(probe: Probe, activation: str, slope: float = TANH_SLOPE) -> dict:
    """fairseq's classification head (dense, activation, out_proj, as wide as the features) set to
    compute the probe: dense standardizes each feature and scales it into tanh's linear range,
    out_proj undoes the scale and applies the probe. Keys relative to the head's prefix."""
    assert activation in ACTIVATIONS, (
        f"a probe becomes a head whose activation is tanh or linear, not {activation} (--pooler-activation-fn)"
    )
    a = slope if activation == "tanh" else 1.0
    return {
        "dense.weight": torch.diag(a / probe.scale).float(),
        "dense.bias": (-a * probe.mean / probe.scale).float(),
        "out_proj.weight": (probe.weight.t() / a).float().contiguous(),
        "out_proj.bias": probe.bias.float(),
    }
