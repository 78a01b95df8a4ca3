"""Numerics and invariants of the Linformer attention module and the linformer_roberta model."""
import argparse
import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.modules import MultiheadAttention

import linformer_fairseq  # noqa: F401  (registers the model)
from linformer_fairseq.models.linformer_roberta import LinformerRobertaConfig, LinformerRobertaModel
from linformer_fairseq.modules import COMPRESS_SHARING, COMPRESS_TYPES, LinformerMultiheadAttention
from linformer_fairseq.modules.linformer_attention import LENGTH_NORM_POWERS, SequenceProjection

VOCAB = 50


def build_model(**overrides):
    """A linformer_roberta built the way fairseq builds it from parsed flags."""
    small = dict(encoder_layers=2, encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_attention_heads=4,
                 max_positions=32, compressed_dim=8, dropout=0.0, attention_dropout=0.0)
    small.update(overrides)
    args = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(LinformerRobertaConfig)})
    vars(args).update(small)
    dictionary = Dictionary()
    for i in range(VOCAB - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    torch.manual_seed(0)
    return LinformerRobertaModel.build_model(args, SimpleNamespace(source_dictionary=dictionary)).eval()


def tokens(length, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(4, VOCAB, (batch, length), generator=g)
    t[:, 0] = 0  # <s>
    return t


def features(model, src):
    return model(src, features_only=True)[0]


def test_exact_against_fairseq_attention_when_k_equals_n_and_projections_are_identity():
    n, C, H, B = 12, 16, 4, 3
    torch.manual_seed(0)
    ref = MultiheadAttention(C, H, self_attention=True).eval()
    lin = LinformerMultiheadAttention(C, H, max_positions=n, compressed_dim=n).eval()
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        getattr(lin, name).load_state_dict(getattr(ref, name).state_dict())
    with torch.no_grad():
        lin.compress_k.weight.copy_(torch.eye(n))
        lin.compress_v.weight.copy_(torch.eye(n))
    x = torch.randn(n, B, C)
    expected, _ = ref(x, x, x, need_weights=False)
    got, _ = lin(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,sharing,length_norm", itertools.product(COMPRESS_TYPES, COMPRESS_SHARING, LENGTH_NORM_POWERS))
def test_padding_invariance_and_backward(kind, sharing, length_norm):
    """A sentence's outputs at its real tokens do not depend on how far its batch pads it,
    at T < n and T = n, with every length handling; every kind trains (finite gradients
    reach the projections)."""
    model = build_model(compress_type=kind, compress_sharing=sharing, compress_length_norm=length_norm,
                        compress_init="xavier")
    n = model.encoder.args.max_positions
    for short_len, batch_len in ((11, 20), (19, n)):
        short, long_ = tokens(short_len, seed=1), tokens(batch_len, seed=2)
        batch = torch.full((2, batch_len), model.encoder.dictionary.pad())
        batch[0, :short_len], batch[1] = short[0], long_[0]
        with torch.no_grad():
            alone, padded = features(model, short), features(model, batch)
        torch.testing.assert_close(padded[0, :short_len], alone[0], atol=1e-5, rtol=0)

    model.train()
    loss = features(model, batch).pow(2).mean()
    loss.backward()
    grads = [p.grad for p in model.encoder.sentence_encoder.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    for attn in (layer.self_attn for layer in model.encoder.sentence_encoder.layers):
        for p in attn.compress_parameters():
            assert p.grad.abs().sum() > 0, f"{kind}/{sharing}: no gradient reaches the projection"


@pytest.mark.parametrize("sharing,expected", [("none", 288), ("headwise", 24), ("kv", 12), ("layerwise", 1)])
def test_distinct_projection_matrices_for_12_layers_12_heads(sharing, expected):
    k, n = 4, 16
    model = build_model(compress_sharing=sharing, encoder_layers=12, encoder_attention_heads=12,
                        encoder_embed_dim=24, encoder_ffn_embed_dim=24, max_positions=n, compressed_dim=k)
    modules = {}
    for layer in model.encoder.sentence_encoder.layers:
        for proj in (layer.self_attn.compress_k, layer.self_attn.compress_v):
            if proj is not None:
                modules[id(proj)] = proj
    assert sum(m.groups for m in modules.values()) == expected
    compress_params = sum(p.numel() for name, p in model.named_parameters() if "compress" in name)
    assert compress_params == expected * k * n


def test_legacy_flags_map_to_sharing_levels():
    assert build_model(shared_kv_compressed=1).encoder.args.compress_sharing == "kv"
    assert build_model(shared_layer_kv_compressed=1).encoder.args.compress_sharing == "layerwise"
    with pytest.raises(ValueError, match="contradicts"):
        build_model(shared_kv_compressed=1, compress_sharing="none")


def test_per_layer_compressed_dims_are_honoured():
    model = build_model(layer_compressed_dims="16,4", compress_type="linear")
    layers = model.encoder.sentence_encoder.layers
    assert [layer.self_attn.compress_k.k for layer in layers] == [16, 4]
    x = torch.randn(10, 2, 32)
    for layer, k in zip(layers, (16, 4)):
        _, weights = layer.self_attn(x, need_weights=True, need_head_weights=True)
        assert weights.shape == (4, 2, 10, k)
        torch.testing.assert_close(weights.sum(-1), torch.ones(4, 2, 10))


def test_compressed_ratio_freeze_and_attention_dropout():
    model = build_model(compressed_dim=0, compressed=4, freeze_compress=1, dropout=0.0, attention_dropout=0.25)
    attn = model.encoder.sentence_encoder.layers[0].self_attn
    assert attn.dropout == 0.25
    assert attn.compress_k.weight.shape == (8, 32)  # k = 32 // 4
    assert not any(p.requires_grad for p in attn.compress_parameters())
    assert attn.q_proj.weight.requires_grad
    shared = build_model(compress_sharing="layerwise", freeze_compress=1).encoder.sentence_encoder.compress_layer
    assert not shared.weight.requires_grad


def test_ffn_chunking_gives_identical_outputs():
    src = tokens(30, batch=2)
    with torch.no_grad():
        full = features(build_model(), src)
        chunked = features(build_model(ffn_chunk_size=7), src)
    torch.testing.assert_close(chunked, full, atol=0, rtol=0)


@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, "linear"), (torch.bfloat16, "max"), (torch.float16, "mean")])
def test_half_precision_forward_on_cpu_tracks_fp32(dtype, kind):
    src = tokens(24, batch=2)
    src[1, 17:] = 1  # padding
    model = build_model(compress_type=kind)
    with torch.no_grad():
        ref = features(model, src)
        out = features(model.to(dtype), src)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_checkpoint_activations_gives_same_gradients():
    src = tokens(20, batch=2)
    grads = []
    for checkpointing in (False, True):
        model = build_model(checkpoint_activations=checkpointing).train()
        layers = model.encoder.sentence_encoder.layers
        assert all(hasattr(layer, "precheckpoint_forward") == checkpointing for layer in layers)
        features(model, src).pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    plain, ckpt = grads
    assert plain.keys() == ckpt.keys()
    for name, grad in ckpt.items():
        torch.testing.assert_close(grad, plain[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(compressed_dim=64), "k=64 must be in 1..max_positions"),
        (dict(compress_sharing="diagonal"), "unknown compress_sharing"),
        (dict(compress_type="fft"), "unknown compress_type"),
        (dict(compress_length_norm="cube"), "unknown compress_length_norm"),
        (dict(compress_init="zeros"), "unknown compress_init"),
        (dict(layer_compressed_dims="8,8,8"), "3 values for 2 encoder layers"),
        (dict(layer_compressed_dims="8,x"), "comma-separated integers"),
        (dict(compress_type="mean", compressed_dim=5), r"needs max_positions \(32\) divisible by k \(5\)"),
        (dict(compress_sharing="layerwise", layer_compressed_dims="8,4"), "cannot vary by layer"),
    ],
)
def test_bad_settings_fail_at_build_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_model(**overrides)


def test_runtime_errors_name_the_problem():
    model = build_model()
    with pytest.raises(ValueError, match="length 33 is longer than max_positions 32"):
        model(tokens(33))
    left_padded = tokens(10, batch=2)
    left_padded[0, :3] = model.encoder.dictionary.pad()
    with pytest.raises(ValueError, match="right-padded"):
        model(left_padded)
    attn = model.encoder.sentence_encoder.layers[0].self_attn
    x = torch.randn(6, 1, 32)
    causal = torch.triu(torch.full((6, 6), float("-inf")), 1)
    with pytest.raises(ValueError, match="cannot be causal"):
        attn(x, attn_mask=causal)
    with pytest.raises(ValueError, match="exceeds max_positions 32"):
        attn(torch.randn(40, 1, 32))


@pytest.mark.parametrize("arch,layers,dim", [("linformer_roberta_base", 12, 768), ("linformer_roberta_large", 24, 1024),
                                             ("linformer_roberta", 12, 768)])
def test_architectures_from_fairseq_train_flags(arch, layers, dim, tmp_path):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(tmp_path), "--user-dir", "linformer_fairseq", "--arch", arch,
                                                "--task", "masked_lm", "--criterion", "masked_lm",
                                                "--compressed-dim", "64", "--compress-sharing", "layerwise"])
    model_cfg = convert_namespace_to_omegaconf(args).model
    assert (model_cfg.encoder_layers, model_cfg.encoder_embed_dim) == (layers, dim)
    assert (model_cfg.max_positions, model_cfg.compressed_dim, model_cfg.compress_sharing) == (512, 64, "layerwise")


@pytest.mark.parametrize("length_norm,groups", itertools.product(LENGTH_NORM_POWERS, (1, 3)))
def test_length_norm_scales_each_sentence_by_its_own_length(length_norm, groups):
    """With E constant, a constant input projects at T real tokens to T/n of its rows at
    T = n; the (n/T)^p factor, T read per sentence from the padding mask, must leave exactly
    (T/n)^(1-p) of it: equal rows at every length under ``linear``."""
    n, k, C = 32, 8, 6
    proj = SequenceProjection("linear", n, k, groups=groups, length_norm=length_norm)
    with torch.no_grad():
        proj.weight.fill_(1.0 / n)
    lengths = torch.tensor([n, 20, 5, 1])
    pad_mask = torch.arange(n).unsqueeze(0) >= lengths.unsqueeze(1)  # B x n, True at pads
    x = torch.full((n, len(lengths), C), 3.0).masked_fill(pad_mask.t().unsqueeze(-1), 0.0)
    out, kept = proj(x, pad_mask)
    assert kept is None and out.shape == (k, len(lengths), C)
    p = LENGTH_NORM_POWERS[length_norm]
    for b, T in enumerate(lengths.tolist()):
        expected = 3.0 * (T / n) ** (1 - p)
        torch.testing.assert_close(out[:, b], torch.full((k, C), expected), atol=1e-5, rtol=0)
    # no padding mask: T is the input's own length
    alone, _ = proj(x[:5, 2:3], None)
    torch.testing.assert_close(alone, out[:, 2:3], atol=1e-6, rtol=0)


def test_mean_init_is_mean_pooling_and_normal_init_matches_the_original():
    n, k = 64, 16
    x = torch.randn(n, 2, 8)
    mean_init = SequenceProjection("linear", n, k, init="mean")
    pooled, _ = SequenceProjection("mean", n, k)(x, None)
    torch.testing.assert_close(mean_init(x, None)[0], pooled, atol=1e-6, rtol=0)
    torch.manual_seed(0)
    normal = SequenceProjection("linear", 512, 128, init="normal").weight
    assert abs(normal.mean().item()) < 1e-3 and abs(normal.std().item() - 0.02) < 5e-4
    xavier = SequenceProjection("linear", 512, 128, init="xavier").weight
    assert abs(xavier.std().item() - 0.0395) < 1e-3


@pytest.mark.parametrize("trained,built", [("sqrt", "linear"), ("linear", "none"), ("none", "sqrt")])
def test_checkpoint_carries_its_length_norm(trained, built):
    """A model built with another setting takes the checkpoint's when loading it, for every
    sharing level's projections, and then gives the trained model's outputs on short input."""
    for sharing in ("headwise", "layerwise", "none"):
        src = tokens(9, batch=2)
        trained_model = build_model(compress_length_norm=trained, compress_sharing=sharing)
        loaded = build_model(compress_length_norm=built, compress_sharing=sharing)
        loaded.load_state_dict(trained_model.state_dict())
        powers = {m.length_power for m in loaded.modules() if isinstance(m, SequenceProjection)}
        assert powers == {LENGTH_NORM_POWERS[trained]}, sharing
        with torch.no_grad():
            torch.testing.assert_close(features(loaded, src), features(trained_model, src), atol=1e-6, rtol=0)


def test_checkpoint_without_length_norm_loads_as_none():
    """Checkpoints older than the option (the original example's) were trained without it."""
    old = build_model(compress_length_norm="none")
    state = {k: v for k, v in old.state_dict().items() if not k.endswith("length_norm_power")}
    new = build_model(compress_length_norm="linear")
    new.load_state_dict(state)
    src = tokens(7)
    with torch.no_grad():
        torch.testing.assert_close(features(new, src), features(old, src), atol=1e-6, rtol=0)
