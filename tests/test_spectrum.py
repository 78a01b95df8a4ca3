"""scripts/attention_spectrum.py: the spectrum of a context mapping of known rank, end to end
on tiny RoBERTa and Linformer checkpoints, and on binarized real text."""

import json
import random

import pytest
import torch
from omegaconf import OmegaConf

import attention_spectrum as spectrum
import study_linearize as study
from linformer_tools import models

TINY = [
    "--encoder-layers",
    "2",
    "--encoder-embed-dim",
    "32",
    "--encoder-ffn-embed-dim",
    "64",
    "--encoder-attention-heads",
    "4",
    "--max-positions",
    "32",
]
ARCHS = {"roberta": ("roberta_base", []), "linformer": ("linformer_roberta_base", ["--compressed-dim", "16"])}


def save_checkpoint(model, cfg, path):
    """The parts of a fairseq-train checkpoint that loading reads."""
    torch.save(
        {
            "args": None,
            "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "model": model.state_dict(),
            "optimizer_history": [
                {"criterion_name": "MaskedLmLoss", "optimizer_name": "none", "lr_scheduler_state": {}, "num_updates": 0}
            ],
            "extra_state": {},
        },
        path,
    )


def tiny_checkpoint(name, data_dir, path, blind_to_position=False):
    torch.manual_seed(0)
    arch, extra = ARCHS[name]
    model, cfg = models.build_model(arch, TINY + extra, data_dir)
    if blind_to_position:
        with torch.no_grad():
            for key, weight in model.named_parameters():
                if "embed_positions" in key:
                    weight.zero_()
                elif key.endswith(("q_proj.weight", "k_proj.weight")):
                    # sharper attention than the 0.02-std init, so every singular value counts
                    weight.normal_(std=0.2)
    save_checkpoint(model, cfg, path)
    return path


def test_rank_r_context_mapping_has_all_its_mass_at_index_r():
    torch.manual_seed(0)
    n, r = 40, 6
    keys = torch.randn(r, 16)[torch.arange(n) % r]  # n keys, r of them distinct
    P = torch.softmax(torch.randn(n, 16) @ keys.T, dim=-1)  # r distinct columns: rank r
    curve = spectrum.cumulative_spectrum(P)
    assert curve.shape == (n,)
    assert curve[r - 1].item() == pytest.approx(1.0, abs=1e-12)
    assert curve[r - 2].item() < 1 - 1e-3
    assert (curve.diff() >= -1e-12).all()
    assert spectrum.at_index(curve, r).item() == pytest.approx(1.0, abs=1e-12)
    assert spectrum.at_index(curve, 10 * n).item() == pytest.approx(1.0)  # K beyond the columns: all of it
    assert spectrum.index_of_mass(curve, 1.0).item() == r  # rank r: all the mass by index r, not before
    assert spectrum.index_of_mass(torch.tensor([0.5, 0.8, 0.9, 1.0]), 0.9).item() == 3
    assert spectrum.index_of_mass(torch.tensor([[0.95, 1.0], [0.2, 1.0]]), 0.9).tolist() == [1, 2]

    full = spectrum.cumulative_spectrum(torch.softmax(3 * torch.randn(n, n), dim=-1))
    assert full[r - 1].item() < 0.9


@pytest.mark.parametrize("name", ARCHS)
def test_tokens_of_r_types_give_rank_r_in_every_layer_and_head(name, tmp_path):
    # Without positional embeddings a position's state depends only on its token, so a text
    # of r distinct tokens (<s>, </s> and three words) gives context mappings of rank r.
    models.write_dict(tmp_path, [f"w{i}" for i in range(20)])
    ckpt = tiny_checkpoint(name, tmp_path, tmp_path / "model.pt", blind_to_position=True)
    rng = random.Random(0)
    lines = [" ".join(rng.choice(["w0", "w1", "w2"]) for _ in range(rng.randint(3, 7))) for _ in range(60)]
    (tmp_path / "text.txt").write_text("\n".join(lines) + "\n")
    r = 5
    out = tmp_path / "out"
    spectrum.main(
        [
            "--checkpoint",
            str(ckpt),
            "--text",
            str(tmp_path / "text.txt"),
            "--index",
            str(r),
            "--max-sentences",
            "6",
            "--out-dir",
            str(out),
        ]
    )

    result = json.loads((out / "spectrum.json").read_text())
    assert result["sentences"] == 6 and result["seq_len"] == 32 and len(result["layers"]) == 2
    columns = 32 if name == "roberta" else 16
    for layer in result["layers"]:
        assert layer["columns"] == columns and len(layer["head_curves"]) == 4
        for curve in layer["head_curves"]:
            assert curve[r - 1] == pytest.approx(1.0, abs=1e-6)
            assert curve[r - 2] < 1 - 1e-4
        assert layer["heads_at_index"] == pytest.approx([1.0] * 4, abs=1e-6)
    assert (out / "spectrum.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_binarized_text_curves_and_summary(wikitext_bin, tmp_path):
    # the checkpoint's cfg points at wikitext_bin, so its dict.txt is found without --data
    ckpt = tiny_checkpoint("roberta", wikitext_bin, tmp_path / "model.pt")
    out = tmp_path / "out"
    spectrum.main(
        [
            "--checkpoint",
            str(ckpt),
            "--data-bin",
            str(wikitext_bin),
            "--seq-len",
            "24",
            "--index",
            "8",
            "--max-sentences",
            "5",
            "--batch-size",
            "2",
            "--out-dir",
            str(out),
        ]
    )

    result = json.loads((out / "spectrum.json").read_text())
    assert result["sentences"] == 5 and result["index"] == 8
    for layer in result["layers"]:
        curves = torch.tensor(layer["head_curves"])
        assert curves.shape == (4, 24)
        assert (curves.diff(dim=-1) >= -1e-9).all() and torch.allclose(curves[:, -1], torch.ones(4))
        assert layer["heads_at_index"] == pytest.approx(curves[:, 7].tolist())
        assert layer["share_at_index"] == pytest.approx(curves[:, 7].mean().item())
        assert layer["heads_index_of_mass"] == [int((c < 0.9 - 1e-9).sum()) + 1 for c in curves]
        assert (
            layer["mean_curve"][layer["index_of_mass"] - 1]
            >= 0.9
            > ([0] + layer["mean_curve"])[layer["index_of_mass"] - 1]
        )
        assert 0 < layer["share_at_index"] < 1  # real text: P has more than 8 significant singular values
    assert (out / "spectrum.png").stat().st_size > 10_000


def test_bad_inputs_fail_naming_the_value(tmp_path, capsys):
    models.write_dict(tmp_path, ["w0", "w1"])
    ckpt = tiny_checkpoint("roberta", tmp_path, tmp_path / "model.pt")
    (tmp_path / "short.txt").write_text("w0 w1 w0\n")
    base = ["--checkpoint", str(ckpt), "--out-dir", str(tmp_path / "out"), "--text", str(tmp_path / "short.txt")]
    for extra, message in [
        (["--seq-len", "64"], "--seq-len 64 must be in 2..32"),
        ([], "the input has 4 tokens"),
        (["--data", str(tmp_path / "nowhere")], "no dict.txt in"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            spectrum.main(base + extra)
        assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_per_layer_k_from_the_spectrum_keeps_its_mean():
    """The linearize study's non-uniform k: proportional to each layer's K(90%), a layer held at
    k = 8 or n leaves the others the rest, so the mean stays the uniform k it is compared with."""
    minilm_n128 = {"layers": [{"index_of_mass": k} for k in (58, 62, 54, 35, 35, 13)]}  # measured
    assert study.spectrum_dims(minilm_n128, 16, 128) == "21,22,19,13,13,8"  # mean 16, not 16.5
    last = list(map(int, study.spectrum_dims(minilm_n128, 16, 128, keep_last=True).split(",")))
    assert last[-1] == 16 and min(last) >= 8 and sum(last) == 96
    # rounded by largest remainders: alone, shares of 15.48, 15.48 and 17.03 round to a sum of 47
    near = {"layers": [{"index_of_mass": k} for k in (10, 10, 11)]}
    assert study.spectrum_dims(near, 16, 128) == "16,15,17"
    wide = {"layers": [{"index_of_mass": k} for k in (1000, 1, 1, 1)]}
    assert study.spectrum_dims(wide, 64, 128) == "128,43,43,42"  # 256 in all
