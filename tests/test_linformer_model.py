"""Numerics and invariants of the Linformer attention module and the linformer_roberta model."""

import argparse
import dataclasses
import itertools
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.utils._pytree as pytree
from fairseq.data import Dictionary
from fairseq.modules import MultiheadAttention
from torch.utils._python_dispatch import TorchDispatchMode

import linformer_fairseq  # noqa: F401  (registers the model)
from linformer_fairseq.models.linformer_roberta import LinformerRobertaConfig, LinformerRobertaModel
from linformer_fairseq.modules import COMPRESS_SHARING, COMPRESS_TYPES, LinformerMultiheadAttention, LinformerSettings
from linformer_fairseq.modules.linformer_attention import LENGTH_NORM_POWERS, SequenceProjection

VOCAB = 50


def build_model(**overrides):
    """A linformer_roberta built the way fairseq builds it from parsed flags."""
    small = dict(
        encoder_layers=2,
        encoder_embed_dim=32,
        encoder_ffn_embed_dim=64,
        encoder_attention_heads=4,
        max_positions=32,
        compressed_dim=8,
        dropout=0.0,
        attention_dropout=0.0,
    )
    small.update(overrides)
    args = argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(LinformerRobertaConfig)})
    vars(args).update(small)
    dictionary = Dictionary()
    for i in range(VOCAB - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    torch.manual_seed(0)
    return LinformerRobertaModel.build_model(args, SimpleNamespace(source_dictionary=dictionary)).eval()


def attention(embed_dim, heads, n, k, dropout=0.0, **choices):
    """A LinformerMultiheadAttention with these settings (headwise, linear unless chosen)."""
    settings = LinformerSettings(max_positions=n, compressed_dims=(k,), **choices)
    return LinformerMultiheadAttention(embed_dim, heads, settings, k, dropout=dropout)


class Float64Ops(TorchDispatchMode):
    """Records every op that reads or makes a float64 tensor: what a device without float64 (Apple's
    MPS) refuses."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(
            isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in pytree.tree_leaves((args, kwargs, out))
        ):
            self.ops.append(str(func))
        return out


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
    lin = attention(C, H, n, n).eval()
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        getattr(lin, name).load_state_dict(getattr(ref, name).state_dict())
    with torch.no_grad():
        lin.compress_k.weight.copy_(torch.eye(n))
        lin.compress_v.weight.copy_(torch.eye(n))
    x = torch.randn(n, B, C)
    expected, _ = ref(x, x, x, need_weights=False)
    got, _ = lin(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kind,sharing,length_norm", list(itertools.product(COMPRESS_TYPES, COMPRESS_SHARING, LENGTH_NORM_POWERS))
)
def test_padding_invariance_and_backward(kind, sharing, length_norm):
    """A sentence's outputs at its real tokens do not depend on how far its batch pads it,
    at T < n and T = n, with every length handling; every kind trains (finite gradients
    reach the projections)."""
    model = build_model(
        compress_type=kind, compress_sharing=sharing, compress_length_norm=length_norm, compress_init="xavier"
    )
    n = model.encoder.args.max_positions
    for short_len, batch_len in ((11, 20), (19, n)):
        short, long_ = tokens(short_len, seed=1), tokens(batch_len, seed=2)
        batch = torch.full((2, batch_len), model.encoder.dictionary.pad())
        batch[0, :short_len], batch[1] = short[0], long_[0]
        with torch.no_grad():
            alone, padded = features(model, short), features(model, batch)
        torch.testing.assert_close(padded[0, :short_len], alone[0], atol=1e-5, rtol=0)

    # training (dropout 0, so train mode is deterministic): the gradients of a loss on the short
    # sentence's real outputs, w.r.t. its token embeddings and every parameter, are the same
    # alone and in the padded batch; its pad positions get none
    model.train()
    weight = torch.randn(short_len, model.encoder.args.encoder_embed_dim, generator=torch.Generator().manual_seed(3))
    grads = []
    for src in (short, batch):
        model.zero_grad()
        embedded = []
        hook = model.encoder.sentence_encoder.embed_tokens.register_forward_hook(
            lambda module, inputs, out: embedded.append(out.detach().requires_grad_()) or embedded[-1]
        )
        try:
            loss = (features(model, src)[0, :short_len] * weight).sum()
        finally:
            hook.remove()
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        grad_embedded, *grad_params = torch.autograd.grad(loss, [embedded[0], *params.values()], allow_unused=True)
        grads.append((grad_embedded[0], dict(zip(params, grad_params))))
    (alone_emb, alone_params), (padded_emb, padded_params) = grads
    grads_by_name = (alone_params, padded_params)
    assert alone_emb.abs().sum() > 0
    torch.testing.assert_close(padded_emb[:short_len], alone_emb, atol=1e-5, rtol=1e-4)
    assert not padded_emb[short_len:].any(), "pad positions receive gradient"
    for name, p in params.items():  # None: unused (e.g. the LM head), as good as zeros
        alone_grad, padded_grad = (torch.zeros_like(p) if g[name] is None else g[name] for g in grads_by_name)
        assert torch.isfinite(padded_grad).all(), name
        torch.testing.assert_close(
            padded_grad, alone_grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{kind}/{sharing} {name}: {m}"
        )
    for attn in (layer.self_attn for layer in model.encoder.sentence_encoder.layers):
        for p in attn.compress_parameters():
            name = next(n for n, q in params.items() if q is p)
            assert padded_params[name].abs().sum() > 0, f"{kind}/{sharing}: no gradient reaches the projection"


@pytest.mark.parametrize("sharing,expected", [("none", 288), ("headwise", 24), ("kv", 12), ("layerwise", 1)])
def test_distinct_projection_matrices_for_12_layers_12_heads(sharing, expected):
    k, n = 4, 16
    model = build_model(
        compress_sharing=sharing,
        encoder_layers=12,
        encoder_attention_heads=12,
        encoder_embed_dim=24,
        encoder_ffn_embed_dim=24,
        max_positions=n,
        compressed_dim=k,
    )
    modules = {}
    for layer in model.encoder.sentence_encoder.layers:
        for proj in (layer.self_attn.compress_k, layer.self_attn.compress_v):
            if proj is not None:
                modules[id(proj)] = proj
    assert sum(m.groups for m in modules.values()) == expected
    compress_params = sum(p.numel() for name, p in model.named_parameters() if "compress" in name)
    assert compress_params == expected * k * n


def test_legacy_flags_map_to_sharing_levels():
    assert build_model(shared_kv_compressed=1).encoder.sentence_encoder.linformer.sharing == "kv"
    assert build_model(shared_layer_kv_compressed=1).encoder.sentence_encoder.linformer.sharing == "layerwise"
    with pytest.raises(ValueError, match="contradicts"):
        build_model(shared_kv_compressed=1, compress_sharing="none")


def test_per_layer_compressed_dims_are_honoured():
    model = build_model(layer_compressed_dims="16,4", compress_type="linear")
    layers = model.encoder.sentence_encoder.layers
    assert [layer.self_attn.compress_k.k for layer in layers] == [16, 4]
    x = torch.randn(10, 2, 32)
    for layer, k in zip(layers, (16, 4)):
        attn = layer.self_attn
        with torch.no_grad():
            out, weights = attn(x, need_weights=True, need_head_weights=True)
            _, values, _ = attn.project_keys_values(x, None)
        assert weights.shape == (4, 2, 10, k)
        assert_weights_reproduce_output(attn, weights, values, out)


def assert_weights_reproduce_output(attn, head_weights, values, out):
    """The returned H x B x T x k' weights are the attention actually applied: each head's
    weights times its k' projected values, through out_proj, give the module's output."""
    H, B, T, rows = head_weights.shape
    v = values.view(rows, B, H, attn.head_dim).permute(2, 1, 0, 3)  # H x B x k' x D
    mixed = torch.matmul(head_weights, v).permute(2, 1, 0, 3).reshape(T, B, H * attn.head_dim)
    torch.testing.assert_close(attn.out_proj(mixed), out, atol=1e-5 * out.abs().max(), rtol=1e-4)


@pytest.mark.parametrize("kind,sharing", list(itertools.product(COMPRESS_TYPES, ("none", "headwise", "kv"))))
def test_need_weights_path_matches_the_sdpa_path_with_padding(kind, sharing):
    """need_weights computes attention by hand (to return the weights); it must give the
    SDPA path's output, with padding, for every kind, and its weights must be what it
    applied: zero on projected rows of padding only, averaged over heads without
    need_head_weights."""
    n, C, H = 32, 16, 4
    torch.manual_seed(0)
    attn = attention(C, H, n, 8, kind=kind, sharing=sharing, length_norm="sqrt", init="xavier").eval()
    T, lengths = 21, torch.tensor([21, 13, 3])
    pad_mask = torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1)
    x = torch.randn(T, len(lengths), C)
    with torch.no_grad():
        sdpa, none = attn(x, key_padding_mask=pad_mask)
        out, head_weights = attn(x, key_padding_mask=pad_mask, need_head_weights=True)
        averaged_out, averaged = attn(x, key_padding_mask=pad_mask, need_weights=True)
        _, values, kept = attn.project_keys_values(x, pad_mask)
    assert none is None
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(averaged_out, sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(averaged, head_weights.mean(0))
    assert_weights_reproduce_output(attn, head_weights, values, sdpa)
    if kind == "linear":
        assert kept is None  # k rows for every sentence
    else:  # pooled: rows holding only padding get no weight
        assert kept is not None and not kept.all()
        assert not head_weights.masked_select(~kept.view(1, -1, 1, kept.size(1))).any()


@pytest.mark.parametrize("need_weights", (False, True))
def test_attention_dropout_applies_in_training_only(need_weights):
    """With attention dropout p, training outputs are random (two forwards differ, and differ
    from eval), unbiased (their mean is the eval output: dropped weights are rescaled by
    1/(1-p)); eval is deterministic; with p = 0 training equals eval. On both attention paths
    (SDPA, and the hand-written one that returns weights) and through the model's flag."""
    C, T, B = 16, 12, 2
    torch.manual_seed(0)
    attn = attention(C, 4, 16, 4, dropout=0.25)
    x = torch.randn(T, B, C)
    pad_mask = torch.zeros(B, T, dtype=torch.bool)
    pad_mask[1, 9:] = True

    def run(seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            return attn(x, key_padding_mask=pad_mask, need_weights=need_weights)[0]

    attn.eval()
    evaluated = run(1)
    torch.testing.assert_close(run(2), evaluated, atol=0, rtol=0)
    attn.train()
    first, second = run(1), run(2)
    assert not torch.allclose(first, second), "training forwards are identical: no attention dropout"
    assert not torch.allclose(first, evaluated), "training equals eval: no attention dropout"
    torch.testing.assert_close(run(1), first, atol=0, rtol=0)  # the seed fixes the mask
    torch.manual_seed(3)
    samples = torch.stack([run() for _ in range(400)])
    # 400 samples: the mean's error is ~5% of the typical spread; a missing 1/(1-p) is 25%
    spread = (samples - evaluated).abs().mean()
    assert (samples.mean(0) - evaluated).abs().mean() < 0.15 * spread
    attn.dropout = 0.0
    torch.testing.assert_close(run(4), evaluated, atol=1e-6, rtol=0)

    # the model's --attention-dropout reaches every layer (the other dropouts are 0 here)
    src = tokens(20, batch=2)
    for p in (0.25, 0.0):
        model = build_model(attention_dropout=p)
        with torch.no_grad():
            evaluated = features(model, src)
            torch.testing.assert_close(features(model, src), evaluated, atol=0, rtol=0)
            model.train()
            torch.manual_seed(1)
            trained = features(model, src)
        if p:
            assert not torch.allclose(trained, evaluated, atol=1e-4)
        else:
            torch.testing.assert_close(trained, evaluated, atol=1e-6, rtol=0)


def test_compressed_ratio_and_freeze():
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


HALF = (torch.bfloat16, torch.float16)


def assert_within_half_precision(out, ref, real, dtype, max_eps, mean_eps):
    """|out - ref| at the real positions, in units of the dtype's machine epsilon times the
    output's scale (max |ref|): at most max_eps, and on average at most mean_eps."""
    error = (out.float() - ref)[real].abs()
    scale, eps = ref[real].abs().max(), torch.finfo(dtype).eps
    worst, mean = (error.max() / (eps * scale)).item(), (error.mean() / (eps * scale)).item()
    assert worst <= max_eps and mean <= mean_eps, (
        f"{dtype}: error max {worst:.2f}, mean {mean:.3f} x eps x scale {scale:.2f} (bounds {max_eps}, {mean_eps})"
    )


# Half precision, tolerances derived rather than guessed: the reference is the fp32 forward of
# the same weights and inputs rounded to the half dtype, so rounding of the weights cancels
# out and only the half-precision arithmetic is left. Measured on these models (both dtypes,
# every kind, torch 2.13 CPU): attention module at most 0.9 eps x scale, mean 0.17; whole
# model at most 1.5, mean 0.14. The bounds below are ~2x that. Dropping the 1/sqrt(d) scale
# in half precision only breaks the module bound 60-1100 fold (the model-level check alone
# would not see it: at init_bert_params' N(0, 0.02) the attention adds little to the
# residual stream, so the module is checked at its own xavier initialisation). A softmax
# computed in half precision (max-subtracted) stays within the bounds: torch's CPU kernels
# accumulate half-precision reductions in fp32, so it is not a precision bug there.
@pytest.mark.parametrize("dtype,kind", list(itertools.product(HALF, COMPRESS_TYPES)))
def test_half_precision_attention_on_cpu_tracks_fp32(dtype, kind):
    torch.manual_seed(0)
    attn = attention(64, 4, 32, 8, kind=kind, init="xavier", length_norm="sqrt").eval()
    T, lengths = 24, torch.tensor([24, 17])
    pad_mask = torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1)
    x = (torch.randn(T, 2, 64) * 2).to(dtype)  # x2: peaked attention (entropy ~1.3 of ln 8)
    with torch.no_grad():
        out = attn.to(dtype)(x, key_padding_mask=pad_mask)[0]
        ref = attn.float()(x.float(), key_padding_mask=pad_mask)[0]
    assert out.dtype == dtype
    assert_within_half_precision(out, ref, ~pad_mask.t(), dtype, max_eps=2.0, mean_eps=0.4)


@pytest.mark.parametrize("dtype,kind", list(itertools.product(HALF, COMPRESS_TYPES)))
def test_half_precision_forward_on_cpu_tracks_fp32(dtype, kind):
    src = tokens(24, batch=2)
    src[1, 17:] = 1  # padding
    model = build_model(compress_type=kind)
    with torch.no_grad():
        out = features(model.to(dtype), src)
        ref = features(model.float(), src)
    assert out.dtype == dtype
    assert_within_half_precision(out, ref, src.ne(1), dtype, max_eps=3.0, mean_eps=0.3)


def test_checkpoint_activations_gives_same_gradients():
    """With dropout and attention dropout on, activation checkpointing must replay each
    layer's forward with the same random state in backward: same seed, same outputs and
    gradients as without checkpointing (and not the gradients of another seed)."""
    src = tokens(20, batch=2)
    target = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(1))
    runs = []
    for checkpointing, seed in ((False, 7), (True, 7), (False, 8)):
        model = build_model(checkpoint_activations=checkpointing, dropout=0.2, attention_dropout=0.3).train()
        layers = model.encoder.sentence_encoder.layers
        assert all(hasattr(layer, "precheckpoint_forward") == checkpointing for layer in layers)
        torch.manual_seed(seed)
        out = features(model, src)
        # not pow(2).mean(): the final layer norm makes sum(out^2) nearly constant (grads ~1e-14)
        (out * target).sum().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain_out, plain), (ckpt_out, ckpt), (_, other_seed) = runs
    torch.testing.assert_close(ckpt_out, plain_out, atol=0, rtol=0)
    assert plain.keys() == ckpt.keys()
    for name, grad in ckpt.items():
        torch.testing.assert_close(grad, plain[name], atol=1e-9, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    # dropout is really on: another seed gives other gradients
    name = "encoder.sentence_encoder.layers.0.self_attn.q_proj.weight"
    assert plain[name].abs().max() > 1e-4
    assert not torch.allclose(other_seed[name], plain[name], atol=1e-4, rtol=1e-2)


class Features(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, src_tokens):
        return self.model(src_tokens, features_only=True)[0]


# TorchScript tracing is documented in docs/model.md; torch 2.13 deprecates it (in favour of torch.export)
@pytest.mark.filterwarnings("ignore:.*torch.jit.trace.* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind", COMPRESS_TYPES)
def test_traced_encoder_matches_eager_at_other_lengths_batches_and_paddings(kind):
    """torch.jit.trace of the encoder generalises: sizes are traced, not baked in, so one
    trace serves every length <= n, batch size and padding, provided the example batch it is
    traced with contains padding. What the trace does not keep (Python control flow, fixed
    at trace time): fairseq drops the padding mask when the example has no padding, so a
    trace of an unpadded example ignores padding later (silently wrong outputs); and the
    input checks are gone (longer than n fails inside TorchScript without the clear message,
    left padding is not detected)."""
    model = build_model(compress_type=kind, compress_length_norm="sqrt", compress_init="xavier")
    pad = model.encoder.dictionary.pad()

    def batch(length, size, lengths=(), seed=5):
        src = tokens(length, batch=size, seed=seed)
        for row, real in enumerate(lengths):
            src[row, real:] = pad
        return src

    example = batch(16, 2, (16, 10))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(Features(model), example, check_trace=False)
        unpadded_trace = torch.jit.trace(Features(model), batch(16, 2), check_trace=False)
        for length, size, lengths in (
            (16, 2, (16, 10)),
            (16, 2, ()),
            (32, 2, (32, 7)),
            (9, 3, (9, 4, 1)),
            (20, 1, ()),
            (5, 4, (5, 5, 2, 3)),
        ):
            src = batch(length, size, lengths)
            torch.testing.assert_close(
                traced(src),
                features(model, src),
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m: f"T={length} B={size} lengths={lengths}: {m}",
            )
        # the documented limits
        src = batch(20, 2, (20, 12))
        assert not torch.allclose(unpadded_trace(src)[1, :12], features(model, src)[1, :12], atol=1e-5), (
            "a trace of an unpadded example now handles padding: update this test and docs/model.md"
        )
        torch.testing.assert_close(unpadded_trace(batch(20, 2)), features(model, batch(20, 2)), atol=1e-5, rtol=1e-5)
        with pytest.raises(Exception) as error:
            traced(batch(40, 2))
        assert "max_positions" not in str(error.value)
        left_padded = batch(16, 2)
        left_padded[0, :3] = pad
        traced(left_padded)  # no error: the right-padding check is not in the trace


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


@pytest.mark.parametrize(
    "arch,layers,dim",
    [("linformer_roberta_base", 12, 768), ("linformer_roberta_large", 24, 1024), ("linformer_roberta", 12, 768)],
)
def test_architectures_from_fairseq_train_flags(arch, layers, dim, tmp_path):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            str(tmp_path),
            "--user-dir",
            "linformer_fairseq",
            "--arch",
            arch,
            "--task",
            "masked_lm",
            "--criterion",
            "masked_lm",
            "--compressed-dim",
            "64",
            "--compress-sharing",
            "layerwise",
        ],
    )
    model_cfg = convert_namespace_to_omegaconf(args).model
    assert (model_cfg.encoder_layers, model_cfg.encoder_embed_dim) == (layers, dim)
    assert (model_cfg.max_positions, model_cfg.compressed_dim, model_cfg.compress_sharing) == (512, 64, "layerwise")


@pytest.mark.parametrize("length_norm,groups", list(itertools.product(("none", "sqrt", "linear", "resample"), (1, 3))))
def test_length_norm_scales_each_sentence_by_its_own_length(length_norm, groups):
    """With E constant, a constant input projects at T real tokens to T/n of its rows at
    T = n; the (n/T)^p factor, T read per sentence from the padding mask, must leave exactly
    (T/n)^(1-p) of it: equal rows at every length under ``linear``, and under ``resample``,
    which spreads E's n columns over the T tokens."""
    n, k, C = 32, 8, 6
    proj = SequenceProjection("linear", n, k, groups=groups, length_norm=length_norm)
    with torch.no_grad():
        proj.weight.fill_(1.0 / n)
    lengths = torch.tensor([n, 20, 5, 1])
    pad_mask = torch.arange(n).unsqueeze(0) >= lengths.unsqueeze(1)  # B x n, True at pads
    x = torch.full((n, len(lengths), C), 3.0).masked_fill(pad_mask.t().unsqueeze(-1), 0.0)
    out, kept = proj(x, pad_mask)
    assert kept is None and out.shape == (k, len(lengths), C)
    p = 1.0 if length_norm == "resample" else LENGTH_NORM_POWERS[length_norm]
    for b, T in enumerate(lengths.tolist()):
        expected = 3.0 * (T / n) ** (1 - p)
        torch.testing.assert_close(out[:, b], torch.full((k, C), expected), atol=1e-5, rtol=0)
    # no padding mask: T is the input's own length
    alone, _ = proj(x[:5, 2:3], None)
    torch.testing.assert_close(alone, out[:, 2:3], atol=1e-6, rtol=0)


@pytest.mark.parametrize("groups", (1, 2))
def test_resample_projects_a_sentence_as_its_tokens_stretched_over_the_block(groups):
    """``resample``: a sentence of L tokens projects as E applied to the n-position block in
    which each token fills n/L positions (an exact repetition when L divides n; for other L,
    checked on a block L times finer with each E column split in L equal parts); at L = n it is
    E itself, and the gradient reaches E."""
    torch.manual_seed(0)
    n, k, C = 32, 8, 6
    proj = SequenceProjection("linear", n, k, groups=groups, length_norm="resample")
    lengths = torch.tensor([n, 16, 5, 1])
    pad_mask = torch.arange(n).unsqueeze(0) >= lengths.unsqueeze(1)
    x = torch.randn(n, len(lengths), C).masked_fill(pad_mask.t().unsqueeze(-1), 0.0)
    out, _ = proj(x, pad_mask)

    def full_block(E, block):  # E (groups x) k x N applied to an N x C block
        heads = block.view(block.size(0), groups, C // groups)
        return torch.einsum("gkt,tgd->kgd", E.view(groups, k, -1), heads).reshape(k, C)

    for b, L in enumerate(lengths.tolist()):
        fine = x[:L, b].repeat_interleave(n, 0)  # each token n times: n L positions
        expected = full_block(proj.weight.repeat_interleave(L, -1) / L, fine)
        torch.testing.assert_close(out[:, b], expected, atol=1e-5, rtol=0)
    out.sum().backward()
    assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("sharing", ("headwise", "none", "kv"))
def test_exact_reads_sentences_of_at_most_k_tokens_with_softmax_attention(sharing):
    """``exact``: in one padded batch, sentences of L <= k tokens get fairseq's softmax attention
    over their own tokens, longer ones what ``resample`` gives them; alone or padded alike."""
    n, k, C, H = 32, 8, 16, 4
    torch.manual_seed(0)
    ref = MultiheadAttention(C, H, self_attention=True).eval()
    exact = attention(C, H, n, k, sharing=sharing, length_norm="exact", init="xavier")
    resample = attention(C, H, n, k, sharing=sharing, length_norm="resample")
    state = exact.state_dict()  # the same weights, read under resample (loading takes the buffer's setting)
    resample.load_state_dict({key: torch.tensor(-1.0) if key.endswith("length_norm_power") else value
                              for key, value in state.items()})  # fmt: skip
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        getattr(ref, name).load_state_dict(getattr(exact, name).state_dict())
    lengths = [3, 8, 9, 20]
    pad_mask = torch.arange(n).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
    x = torch.randn(n, len(lengths), C).masked_fill(pad_mask.t().unsqueeze(-1), 0.0)
    with torch.no_grad():
        batched, _ = exact(x, key_padding_mask=pad_mask)
        for b, L in enumerate(lengths):
            alone = x[:L, b : b + 1]
            if L <= k:
                expected, _ = ref(alone, alone, alone, need_weights=False)
            else:
                expected, _ = resample(alone)
            torch.testing.assert_close(batched[:L, b : b + 1], expected, atol=1e-5, rtol=0, msg=f"L={L}")
            torch.testing.assert_close(exact(alone)[0], expected, atol=1e-5, rtol=0, msg=f"L={L} alone")


@pytest.mark.parametrize("lengths", ([3, 5, 7, 6, 4, 2, 7, 5, 3, 6, 4, 7], [3, 8, 12, 5, 20, 7, 4, 6, 9, 2, 8, 5]))
def test_resample_prob_reads_some_short_sentences_projected_in_every_layer(lengths):
    """--compress-resample-prob: in training, each sentence that fits k is read either exactly or as
    ``resample`` reads it, in every layer alike (its features are one model's or the other's, not a
    mix); longer sentences are read as before; in eval every short sentence is read exactly."""
    model = build_model(compress_length_norm="exact", compress_resample_prob=0.5)
    state = model.state_dict()
    resample = build_model(compress_length_norm="resample")
    resample.load_state_dict({key: torch.tensor(-1.0) if key.endswith("length_norm_power") else value
                              for key, value in state.items()})  # fmt: skip
    src = tokens(max(lengths), batch=len(lengths), seed=1)
    for b, L in enumerate(lengths):
        src[b, L:] = 1  # right padding
    with torch.no_grad():
        alone = [(features(model, src[b : b + 1, :L])[0], features(resample, src[b : b + 1, :L])[0])
                 for b, L in enumerate(lengths)]  # fmt: skip
        batched = features(model, src)
        for b, L in enumerate(lengths):
            torch.testing.assert_close(batched[b, :L], alone[b][0], atol=1e-5, rtol=0)
        torch.manual_seed(0)
        trained = features(model.train(), src)
    readings = []
    for b, L in enumerate(lengths):
        exact, projected = alone[b]
        as_exact = torch.allclose(trained[b, :L], exact, atol=1e-5, rtol=0)
        as_projected = torch.allclose(trained[b, :L], projected, atol=1e-5, rtol=0)
        assert as_exact or as_projected, f"sentence {b} (L={L}) read as neither reading"
        if L > 8:
            assert as_exact and as_projected, "a sentence longer than k is read as before"
        else:
            readings.append("projected" if as_projected else "exact")
    assert set(readings) == {"exact", "projected"}, readings
    with pytest.raises(ValueError, match="needs --compress-type linear --compress-length-norm exact"):
        build_model(compress_length_norm="resample", compress_resample_prob=0.5)


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


def test_model_builds_from_an_argparse_namespace(tmp_path):
    """Older fairseq scripts build the model from parse_args_and_arch's Namespace, which holds
    only the flags given: the architectures must fill the Linformer defaults themselves."""
    from fairseq import options, tasks

    (tmp_path / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(20)))
    for arch, layers, dim in (("linformer_roberta_base", 12, 768), ("linformer_roberta_large", 24, 1024)):
        args = options.parse_args_and_arch(
            options.get_training_parser(),
            [
                str(tmp_path),
                "--user-dir",
                "linformer_fairseq",
                "--arch",
                arch,
                "--task",
                "masked_lm",
                "--max-positions",
                "64",
                "--compressed-dim",
                "16",
            ],
        )
        model = tasks.setup_task(args).build_model(args)
        encoder = model.encoder.sentence_encoder
        assert (len(encoder.layers), encoder.embed_tokens.embedding_dim) == (layers, dim)
        attn = encoder.layers[0].self_attn
        assert (attn.compress_sharing, attn.compress_k.k, attn.compress_k.length_power) == ("headwise", 16, 1.0)


def test_checkpoint_with_its_config_loads_under_the_safe_loader():
    """When several ranks resume, fairseq's rank 0 sends the loaded checkpoint (its config an
    omegaconf DictConfig) to the others, which torch.load it with weights_only=True."""
    import io

    from omegaconf import OmegaConf

    state = {
        "cfg": OmegaConf.create({"model": {"_name": "linformer_roberta", "layers": [1, 2]}, "seed": None}),
        "args": argparse.Namespace(arch="linformer_roberta"),
        "model": build_model().state_dict(),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True, torch's default
    assert OmegaConf.to_container(loaded["cfg"]) == OmegaConf.to_container(state["cfg"])
    assert loaded["args"].arch == "linformer_roberta"


@pytest.mark.parametrize(
    "choices",
    [{}, {"compress_length_norm": "exact"}, {"compress_type": "conv"},
     {"compress_length_norm": "resample", "local_window": 4, "local_count_once": True}],
)  # fmt: skip
def test_a_float32_forward_runs_no_float64_op(choices):
    """The plain Linformer (defaults, exact, pooling) and the band with its recount run on a device
    without float64: no op of a padded forward reads or makes one."""
    model = build_model(**choices)
    src = tokens(30, batch=2)
    src[1, 11:] = 1  # padded
    with torch.no_grad(), Float64Ops() as seen:
        features(model, src)
    assert seen.ops == [], seen.ops
