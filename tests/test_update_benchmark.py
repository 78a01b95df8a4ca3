"""scripts/benchmark.py --mode update (fairseq's Trainer.train_step against the model's bare step)
and the plugin's ``adam_fused`` optimizer: the update is a real one (the loss falls, one update
equals a hand-made AdamW step of the same gradients), the summary line is printed, bad input is
refused, and adam_fused makes fairseq's adam's update (also for a parameter that misses gradients, across
a checkpoint, and on fairseq's flat fp16 path)."""

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIG, call_main

import benchmark as bench
import linformer_fairseq  # noqa: F401  (registers adam_fused)
from linformer_tools import mfu, update

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
    # the model's shapes from the composed config: kv sharing, k = 8, V = --vocab-size (its <mask> included)
    shape = dict(d=32, f=64, layers=2, vocab=120, masked_share=0.15, k=[8, 8], sharing="kv", kind="linear", window=0)
    assert result["shape"] == shape and result["sentences"] == 4 and result["real_tokens"] == 4 * 32
    assert result["flops_per_update"] == 4 * mfu.matmul_flops(32, 32, 64, 2, 8, "kv", vocab=120)
    assert result["mfu"] == {"update": None, "step": None} and result["peak"] == "no MFU on cpu"
    assert "TFLOP an update: MFU update -, bare step - (no MFU on cpu)" in out


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


ADAM = dict(adam_betas="(0.9,0.98)", adam_eps=1e-6, weight_decay=0.01, lr=[0.01])  # as the recipe's


def build_adam(name, params, impl="fused"):
    """fairseq's adam (its own Adam class, as without apex or a GPU) or the plugin's adam_fused."""
    from fairseq import optim
    from omegaconf import OmegaConf

    extra = dict(use_old_adam=True, tpu=False, fp16_adam_stats=False) if name == "adam" else dict(adam_fused_impl=impl)
    return optim.build_optimizer(OmegaConf.create(dict(ADAM, _name=name, **extra)), params)


def head_misses(step):
    """The head (the third parameter) is frozen for two steps, then unused on the sixth."""
    return step in (0, 1, 5)


def set_grads(params, step):
    """fp32 training: a parameter without a gradient has none (fairseq's zero_grad sets None);
    gradients from 1e-2 down to 1e-9, below eps, where the eps (and so the step count) matters."""
    g = torch.Generator().manual_seed(step)
    for i, p in enumerate(params):
        p.grad = None if i == 2 and head_misses(step) else torch.randn(p.shape, generator=g) * 10.0 ** -(2 + step)


def small_weights():
    torch.manual_seed(0)  # the model's init scale, so that float32 rounding of the weights is ~1e-9
    return [torch.randn(40, 30) * 0.02, torch.randn(30) * 0.02, torch.randn(8, 30) * 0.02]


def max_diff(ours, theirs):
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_adam_fused_counts_steps_per_parameter_as_fairseqs_adam(impl):
    """A head without gradients on some steps is stepped fewer times; its bias corrections and eps
    follow its own count, as in fairseq's adam (the earlier count per group put it 1.3e-3 off here)."""
    start = small_weights()
    ours, theirs = ([torch.nn.Parameter(p.clone()) for p in start] for _ in range(2))
    fused, reference = build_adam("adam_fused", ours, impl), build_adam("adam", theirs)
    for step in range(8):
        for params, opt in ((ours, fused), (theirs, reference)):
            set_grads(params, step)
            opt.step()
        assert max_diff(ours, theirs) <= 1e-7, step
    assert reference.optimizer.state[theirs[2]]["step"] == 5 == fused.optimizer.state[ours[2]]["step"]
    assert max_diff(ours, start) > 0.01  # the weights moved


@pytest.mark.parametrize("layout", ["current", "legacy"])
def test_adam_fused_resumes_from_a_checkpoint_as_fairseqs_adam(layout, tmp_path):
    """Four steps, a checkpoint as fairseq's Trainer writes and reads it (move_to_cpu, torch.save,
    torch.load with weights_only=True, a new optimizer on the weights, load_state_dict), four more:
    the weights of fairseq's adam run without a stop. ``legacy``: the layout the earlier adam_fused
    saved (one count per param group, none per parameter)."""
    from fairseq import utils

    start = small_weights()
    ours, theirs = ([torch.nn.Parameter(p.clone()) for p in start] for _ in range(2))
    fused, reference = build_adam("adam_fused", ours), build_adam("adam", theirs)
    for step in range(8):
        if step == 4:
            torch.save(utils.move_to_cpu(fused.state_dict()), tmp_path / "checkpoint.pt")
            state = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
            if layout == "legacy":
                for param_state in state["state"].values():
                    param_state.pop("fairseq_step", None)
                for group in state["param_groups"]:
                    group["fairseq_step"] = step
            ours = [torch.nn.Parameter(p.detach().clone()) for p in ours]
            fused = build_adam("adam_fused", ours)
            fused.load_state_dict(state, {})  # the trainer's optimizer_overrides: "{}"
        for params, opt in ((ours, fused), (theirs, reference)):
            set_grads(params, step)
            opt.step()
        assert max_diff(ours, theirs) <= 1e-7, step
    assert all("fairseq_step" not in group for group in fused.param_groups)


def test_adam_fused_matches_fairseqs_adam_under_flat_fp16(monkeypatch, tmp_path):
    """fairseq's FP16Optimizer with flattened fp32 master weights (--fp16 without
    --memory-efficient-fp16), driven as the Trainer drives it: scaled backward, multiply_grads,
    clipping, a step skipped on overflow, a checkpoint round trip. FP16Optimizer runs on the CPU
    but for one call: it asks CUDA for the device of the flat buffer, and the CPU's index is None."""
    from fairseq import optim
    from omegaconf import OmegaConf

    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    common = dict(fp16=True, bf16=False, fp16_no_flatten_grads=False, memory_efficient_fp16=False)
    common.update(fp16_scale_window=None, fp16_init_scale=128, fp16_scale_tolerance=0.0, threshold_loss_scale=None)
    common.update(min_loss_scale=1e-4, model_parallel_size=1)
    rest = dict(common=common, optimization=dict(update_freq=[1]), distributed_training=dict(distributed_world_size=1))

    def build(name, params):
        extra = dict(use_old_adam=True, tpu=False, fp16_adam_stats=False) if name == "adam" else {}
        return optim.FP16Optimizer.build_optimizer(
            OmegaConf.create(dict(rest, optimizer=dict(ADAM, _name=name, **extra))), params
        )

    def resume(name, params, opt, path):
        torch.save(opt.state_dict(), path)  # FP16Optimizer's: adam's state and the loss scale
        params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = build(name, params)
        opt.load_state_dict(torch.load(path, weights_only=True), {})
        return params, opt

    def train_step(params, opt, step):
        opt.zero_grad()  # the Trainer's first call: it sets the unscaling factor from the loss scale
        g = torch.Generator().manual_seed(step)
        loss = sum(
            (p.float() * torch.randn(p.shape, generator=g) * (1e5 if step == 3 else 1e-3)).sum()
            for i, p in enumerate(params)
            if not (i == 2 and head_misses(step))
        )
        opt.backward(loss)  # scaled by the loss scale; step 3's half-precision gradients overflow
        opt.multiply_grads(0.5)  # 1 / sample_size
        try:
            opt.clip_grad_norm(0.05)
        except OverflowError:  # the scaler lowered the loss scale; the Trainer skips the step
            return
        opt.step()

    start = [p.half() for p in small_weights()]
    ours, theirs = ([torch.nn.Parameter(p.clone()) for p in start] for _ in range(2))
    fused, reference = build("adam_fused", ours), build("adam", theirs)
    assert fused.has_flat_params and [p.numel() for p in fused.fp32_optimizer.params] == [sum(p.numel() for p in ours)]
    for step in range(8):
        if step == 4:  # both resume: the new fp32 master weights are the fp16 weights, as in fairseq
            ours, fused = resume("adam_fused", ours, fused, tmp_path / "ours.pt")
            theirs, reference = resume("adam", theirs, reference, tmp_path / "theirs.pt")
        train_step(ours, fused, step)
        train_step(theirs, reference, step)
        assert max_diff(fused.fp32_optimizer.params, reference.fp32_optimizer.params) <= 1e-7, step
        for a, b in zip(ours, theirs):  # masters 1e-8 apart can round to neighbouring fp16 values: one ulp
            torch.testing.assert_close(a, b, rtol=2**-10, atol=2**-24, msg=f"step {step}")
    assert fused.scaler.loss_scale == reference.scaler.loss_scale == 64  # the overflow halved it
    assert reference.optimizer.state[next(reference.fp32_optimizer.params)]["step"] == 7
    assert max_diff(ours, start) > 0.01


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "fp16"], "--mode update --dtype fp16 needs --device cuda"),
        (["--config", "nope"], "no pretraining config ['nope']"),
        (["--override", "model.dropout"], "--override takes KEY=VALUE"),
        (["--data", "/no/such/bin"], "not a fairseq data-bin"),
        (["--pretrain-log", "roberta_base=x.log"], "--pretrain-log takes CONFIG=LOG for a CONFIG of --config"),
    ],
)
def test_update_mode_refuses_bad_input(argv, message, tmp_path, capsys):
    assert call_main(bench, "--mode", "update", *argv, "--out-dir", tmp_path) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# pretrain.sh's hydra_train.log (a CPU run of the tiny model, log_interval 50, 200 updates), after the
# records of an earlier run in the same save dir; the hydra lines as fairseq-hydra-train writes them (a
# backslash ends a line of the string that continues on the next)
EARLIER_RUN = """\
[2026-12-01 21:20:01,000][train_inner][INFO] - {"epoch": 1, "ups": "1.0", "wpb": "10", "bsz": "1", "num_updates": "50"}
[2026-12-01 21:20:51,000][train_inner][INFO] - {"epoch": 1, "ups": "1.0", "wpb": "10", "bsz": "1", "num_updates": "100"}
"""
CPU_RUN = """\
[2026-12-01 21:23:53,041][train_inner][INFO] - {"epoch": 1, "update": 0.033, "loss": "13.362", "ppl": "10532", \
"wps": "1500.6", "ups": "11.19", "wpb": "134.2", "bsz": "8", "num_updates": "50", "lr": "0.000382653", "wall": "10"}
[2026-12-01 21:23:57,082][train_inner][INFO] - {"epoch": 1, "update": 0.065, "loss": "12.111", "ppl": "4422.62", \
"wps": "1648", "ups": "12.39", "wpb": "133", "bsz": "8", "num_updates": "100", "lr": "0.000255102", "wall": "14"}
[2026-12-01 21:24:00,258][train_inner][INFO] - {"epoch": 1, "update": 0.098, "loss": "11.142", "ppl": "2259.56", \
"wps": "2003.6", "ups": "15.8", "wpb": "126.8", "bsz": "8", "num_updates": "150", "lr": "0.000127551", "wall": "17"}
[2026-12-01 21:24:03,798][train_inner][INFO] - {"epoch": 1, "update": 0.13, "loss": "10.783", "ppl": "1761.77", \
"wps": "2042", "ups": "14.17", "wpb": "144.2", "bsz": "8", "num_updates": "200", "lr": "0", "wall": "21"}
[2026-12-01 21:24:04,321][valid][INFO] - {"epoch": 1, "valid_loss": "11.016", "valid_num_updates": "200"}
"""


def test_pretrain_steady_state_counts_updates_51_to_200_of_the_last_run(tmp_path):
    """Each record's ups times the updates since the previous record: 150 updates over
    50/12.39 + 50/15.8 + 50/14.17 seconds; the first 50 and the earlier run are left out."""
    log = tmp_path / "hydra_train.log"
    log.write_text(EARLIER_RUN + CPU_RUN)
    steady = update.pretrain_steady(log)
    seconds = 50 / 12.39 + 50 / 15.8 + 50 / 14.17
    assert steady["ups"] == pytest.approx(150 / seconds) and round(steady["ups"], 2) == 13.98
    assert (steady["from"], steady["to"], steady["windows"], steady["epochs"]) == (51, 200, [12.39, 15.8, 14.17], [1])
    assert steady["bsz"] == 8 and steady["wpb"] == pytest.approx((133 + 126.8 + 144.2) / 3)
    # the records' timestamps agree: 150 updates from 21:23:53.041 to 21:24:03.798, 10.757 s, of which the
    # ups leave out the logging itself (and are rounded to 0.01)
    assert 150 / steady["ups"] == pytest.approx(10.757, abs=0.05)
    # an epoch that ends between two records is named; a log without the record at 50 gives nothing
    log.write_text(CPU_RUN.replace('"epoch": 1, "update": 0.098', '"epoch": 2, "update": 1.01'))
    assert update.pretrain_steady(log)["epochs"] == [1, 2]
    log.write_text(CPU_RUN.split("\n", 1)[1])
    assert update.pretrain_steady(log) is None
    assert update.pretrain_steady(tmp_path / "absent.log") is None


def test_pretrain_table_sets_pretrain_beside_the_update_with_mfu(tmp_path, monkeypatch):
    """pretrain.sh's updates/s over the update's and the bare step's, and each row's MFU: model
    FLOPs an update x updates/s over the GPU's dense peak (none for a GPU not in the table)."""
    log = tmp_path / "hydra_train.log"
    log.write_text(CPU_RUN)
    shape = dict(d=32, f=64, layers=2, vocab=120, masked_share=0.15)
    flops = update.update_flops(shape, 8, 1024)
    result = dict(config="roberta_base", n=128, batch_size=8, update_ms=50.0, step_ms=40.0, shape=shape)
    result |= dict(sentences=8, real_tokens=1024, mfu={"update": flops / 0.05 / 989e12, "step": None})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    table = update.pretrain_table([result], {"roberta_base": log}, "fp16", "cuda").splitlines()
    steady = update.pretrain_steady(log)
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    pretrain_mfu = update.update_flops(shape, 8, steady["wpb"]) * steady["ups"] / 989e12
    assert cells == [
        "`roberta_base`", "128 x 8", "13.98 (51-200)", "20.00", "**0.70**", "25.00", "0.56",
        mfu.percent(pretrain_mfu), mfu.percent(flops / 0.05 / 989e12), "-",
    ]  # fmt: skip
    assert table[-1] == "- peak: H100 SXM's dense bf16/fp16 peak, 989 TFLOP/s"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 PCIe")
    table = update.pretrain_table([result], {"roberta_base": log}, "fp16", "cuda").splitlines()
    assert table[-1] == "- MFU: unknown GPU: no MFU (NVIDIA H100 PCIe)" and "| - | " in table[2]
    missing = update.pretrain_table([result], {"roberta_base": tmp_path / "none.log"}, "fp16", "cpu")
    assert f"no record at update 50 and after in {tmp_path / 'none.log'}" in missing
