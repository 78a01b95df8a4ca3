"""scripts/benchmark.py --mode update (fairseq's Trainer.train_step against the model's bare step)
and the plugin's ``adam_fused`` optimizer: the update is a real one (the loss falls, one update
equals a hand-made AdamW step of the same gradients), the summary line is printed, bad input is
refused, and adam_fused makes fairseq's adam's update."""

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIG, call_main

import benchmark as bench
import linformer_fairseq  # noqa: F401  (registers adam_fused)
from linformer_tools import update

# a 2-layer model of width 32 on 32-token sequences: seconds per run on a CPU
TINY = [
    "--mode", "update", "--config", CONFIG, "--lengths", "32", "--encoder-layers", "2", "--encoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--override", "model.compressed_dim=8",
    "--vocab-size", "120", "--batch-size", "4", "--threads", "1", "--min-run-time", "0.1", "--profile-steps", "1",
]  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_update_mode_prints_the_speed_and_the_update_learns(dtype, tmp_path, capsys):
    argv = TINY + ["--dtype", dtype, "--batches", "1", "--warmup", "12", "--out-dir", tmp_path]
    argv += ["--override", "lr_scheduler.warmup_updates=1", "--override", "optimization.lr=[0.003]"]
    assert call_main(bench, *argv) == 0
    out = capsys.readouterr().out
    speed = re.findall(r"^update/step speed: (\d+\.\d+)", out, re.M)
    assert len(speed) == 1 and out.rstrip().splitlines()[-1].startswith("update/step speed: ")
    (result,) = json.loads((tmp_path / "update.json").read_text())["results"]
    assert float(speed[0]) == pytest.approx(result["step_ms"] / result["update_ms"], abs=0.006)
    assert result["update_ms"] > 0 and result["step_ms"] > 0 and result["n"] == 32
    assert ("FP16Optimizer" in result["optimizer"]) == (dtype == "bf16")  # fairseq's bf16: fp32 master weights
    assert {"aten::item", "aten::copy_", "optimizer CPU ms"} <= set(result["profile"]["update"])
    losses = result["losses"]  # the same batch again and again: fairseq's updates learn it
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("optimizer", ["adam", "adam_fused"])
def test_one_update_equals_a_hand_made_adamw_step(optimizer, tmp_path):
    """From the same weights and batch (no dropout): the trainer's update is the bare model's
    masked-LM mean loss, its gradients, and one AdamW step with fairseq's eps placement."""
    args = bench.build_parser().parse_args(TINY[:-4] + ["--override", f"optimizer._name={optimizer}"])
    args.override += ["model.dropout=0", "model.attention_dropout=0", "lr_scheduler.warmup_updates=0"]
    args.override += ["optimization.lr=[0.001]", "optimizer.weight_decay=0.1"]
    data = tmp_path / "data"
    data.mkdir()
    update.models.write_dict(data, [f"w{i}" for i in range(100)])
    cfg, task, trainer = update.build(args, CONFIG, 32, data, tmp_path / "save")
    sample = update.synthetic_batch(task, 4, 32)
    model = update.bare_model(task, trainer, cfg, "fp32", "cpu")
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer.train_step([sample])

    target = sample["target"]
    masked = target.ne(task.source_dictionary.pad())
    logits = model(sample["net_input"]["src_tokens"], masked_tokens=masked)[0]
    torch.nn.functional.cross_entropy(logits, target[masked]).backward()
    betas, eps = (0.9, 0.98), 1e-6
    # step 1: fairseq's sqrt(v) + eps equals PyTorch's sqrt(v / (1 - b2)) + eps / sqrt(1 - b2)
    eps_after_correction = eps / math.sqrt(1 - betas[1])
    torch.optim.AdamW(model.parameters(), lr=1e-3, betas=betas, eps=eps_after_correction, weight_decay=0.1).step()
    updated = dict(trainer.model.named_parameters())
    moved = max((p - before[name]).abs().max() for name, p in model.named_parameters())
    assert moved > 5e-4  # the update moved weights by about lr (where gradients are well above eps)
    for name, p in model.named_parameters():
        torch.testing.assert_close(updated[name], p, atol=2e-6, rtol=0, msg=name)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_adam_fused_matches_fairseqs_adam(impl):
    """Five steps, weight decay on, gradients from 1e-2 down to 1e-8 (below eps, where fairseq's
    eps placement and PyTorch's differ): the same weights as fairseq's Adam, to float32 rounding."""
    from fairseq import optim
    from fairseq.optim.adam import FairseqAdam
    from omegaconf import OmegaConf

    torch.manual_seed(0)
    start = [torch.randn(40, 30), torch.randn(30)]
    ours, theirs, plain = ([torch.nn.Parameter(p.clone()) for p in start] for _ in range(3))
    settings = dict(adam_betas="(0.9,0.98)", adam_eps=1e-6, weight_decay=0.01, lr=[0.01])  # as the recipe's
    fused = optim.build_optimizer(OmegaConf.create(dict(settings, _name="adam_fused", adam_fused_impl=impl)), ours)
    reference = FairseqAdam(SimpleNamespace(**settings, tpu=False, fp16_adam_stats=False), theirs)
    torch_adamw = torch.optim.AdamW(plain, lr=0.01, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    assert type(fused).__name__ == "FairseqFusedAdam" and fused.optimizer.defaults[impl]
    for step in range(5):
        grads = [torch.randn_like(p) * 10.0 ** -(2 + 1.5 * step) for p in start]
        for params, opt in ((ours, fused), (theirs, reference), (plain, torch_adamw)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    # PyTorch's own AdamW (eps after the bias correction) ends elsewhere: the placement matters
    assert max((a - b).abs().max() for a, b in zip(plain, theirs)) > 1e-3
    # the gradient norm (one multi-tensor kernel) is fairseq's
    for p in ours:
        p.grad = torch.randn_like(p)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours]))
    torch.testing.assert_close(fused.clip_grad_norm(0), expected)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "fp16"], "--mode update --dtype fp16 needs --device cuda"),
        (["--config", "nope"], "no pretraining config ['nope']"),
        (["--override", "model.dropout"], "--override takes KEY=VALUE"),
        (["--data", "/no/such/bin"], "not a fairseq data-bin"),
    ],
)
def test_update_mode_refuses_bad_input(argv, message, tmp_path, capsys):
    assert call_main(bench, "--mode", "update", *argv, "--out-dir", tmp_path) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
