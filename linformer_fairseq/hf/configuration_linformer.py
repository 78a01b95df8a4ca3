"""Configuration of a Linformer (or RoBERTa) exported from fairseq to Hugging Face transformers.

Depends only on transformers. ``scripts/export_hf.py`` writes it, with ``modeling_linformer.py``
and the attention's files (``linformer_attention.py`` and those it imports), into the exported
folder, which transformers loads with ``trust_remote_code=True``. Field names follow transformers
where it has one (``hidden_size``, ``num_hidden_layers``, ...); the Linformer's own fields keep the
plugin's flag names.
"""

from transformers import PretrainedConfig


class LinformerConfig(PretrainedConfig):
    r"""
    Args:
        vocab_size (`int`): rows of the token embedding: fairseq's dictionary, `<mask>` included.
        hidden_size (`int`): `--encoder-embed-dim`.
        num_hidden_layers (`int`): `--encoder-layers`.
        num_attention_heads (`int`): `--encoder-attention-heads`.
        intermediate_size (`int`): `--encoder-ffn-embed-dim`.
        hidden_act (`str`): `--activation-fn` (relu, gelu, gelu_fast, gelu_accurate, tanh, linear, swish,
            relu_squared), used in the layers and the masked-LM head.
        hidden_dropout_prob (`float`): `--dropout`.
        attention_probs_dropout_prob (`float`): `--attention-dropout`.
        activation_dropout (`float`): `--activation-dropout` (after the FFN's activation).
        classifier_dropout (`float`): `--pooler-dropout`, the classification head's dropout.
        classifier_activation (`str`): `--pooler-activation-fn` of the classification head.
        classifier_pooling (`str`): `--pooler-tokens`, what the classification head reads: "first", the final
            state of `<s>`; "mean", the mean of the real tokens' final states.
        classifier_inner_dim (`int`, *optional*): width of the classification head's dense layer
            (default: `hidden_size`).
        max_positions (`int`): n, `--max-positions`: the longest input, and the length the projections E/F map from.
        layer_norm_eps (`float`): fairseq's LayerNorm epsilon, 1e-5.
        normalize_before (`bool`): `--encoder-normalize-before` (pre-norm layers and a final layer norm).
        layernorm_embedding (`bool`): layer norm after the embeddings (RoBERTa's).
        embed_scale (`float`): factor on the token embeddings (1.0, or sqrt(hidden_size) without
            `--no-scale-embedding`).
        untie_weights_roberta (`bool`): the masked-LM head has its own output matrix instead of the token embedding.
        attention (`str`): `"linformer"`, or `"full"` for a fairseq RoBERTa (softmax attention over all tokens).
        compressed_dims (`list[int]`): k of each layer (`--compressed-dim`, `--compressed` or
            `--layer-compressed-dims`).
        compress_sharing (`str`): none, headwise, kv or layerwise (`--compress-sharing`).
        compress_type (`str`): linear, mean, max or conv (`--compress-type`).
        compress_length_norm (`str`): none, sqrt, linear, resample or exact: what the checkpoint's linear
            projections do with inputs shorter than n (`--compress-length-norm`).
        compress_init (`str`): normal, xavier or mean: the init of new linear projections (`--compress-init`).
        freeze_compress (`bool`): the projections are not trained (`--freeze-compress 1`).
        local_window (`int`): W, the exact local band each query reads beside the projected rows
            (`--local-window`; 0: none).
        local_count_once (`bool`): each projected row leaves out the tokens of its window that the query's
            band reads (`--local-count-once`).
        local_kernel (`str`): auto, blockwise or flex: how the band is computed (`--local-kernel`); the
            numbers are the same, only speed and memory differ.
        ffn_chunk_size (`int`): in inference, run each feed-forward block over this many positions at a
            time (0: off); same outputs.
        initializer_range (`float`): std of the normal init of new weights (a new classification head).
        mask_token_id (`int`, *optional*): the id of `<mask>`, the last row when the model was pretrained
            with masked LM.

    Label names (`id2label`, `label2id`), `num_labels` and `problem_type` (`"regression"` for a
    one-output head) are transformers' own fields.
    """

    model_type = "linformer_fairseq"

    def __init__(
        self,
        vocab_size=50265,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        activation_dropout=0.0,
        classifier_dropout=0.0,
        classifier_activation="tanh",
        classifier_inner_dim=None,
        classifier_pooling="first",
        max_positions=512,
        layer_norm_eps=1e-5,
        normalize_before=False,
        layernorm_embedding=True,
        embed_scale=1.0,
        untie_weights_roberta=False,
        attention="linformer",
        compressed_dims=None,
        compress_sharing="headwise",
        compress_type="linear",
        compress_length_norm="linear",
        compress_init="normal",
        freeze_compress=False,
        local_window=0,
        local_count_once=False,
        local_kernel="auto",
        ffn_chunk_size=0,
        initializer_range=0.02,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        unk_token_id=3,
        mask_token_id=None,
        **kwargs,
    ):
        if attention not in ("linformer", "full"):
            raise ValueError(f"attention must be 'linformer' or 'full', got {attention!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.activation_dropout = activation_dropout
        self.classifier_dropout = classifier_dropout
        self.classifier_activation = classifier_activation
        self.classifier_inner_dim = classifier_inner_dim
        if classifier_pooling not in ("first", "mean"):
            raise ValueError(f"classifier_pooling must be 'first' or 'mean', got {classifier_pooling!r}")
        self.classifier_pooling = classifier_pooling
        self.max_positions = max_positions
        self.layer_norm_eps = layer_norm_eps
        self.normalize_before = normalize_before
        self.layernorm_embedding = layernorm_embedding
        self.embed_scale = embed_scale
        self.untie_weights_roberta = untie_weights_roberta
        self.attention = attention
        if compressed_dims is None:
            compressed_dims = [max_positions // 4] * num_hidden_layers
        self.compressed_dims = [int(k) for k in compressed_dims]
        if len(self.compressed_dims) != num_hidden_layers:
            raise ValueError(f"compressed_dims has {len(self.compressed_dims)} values for {num_hidden_layers} layers")
        self.compress_sharing = compress_sharing
        self.compress_type = compress_type
        self.compress_length_norm = compress_length_norm
        self.compress_init = compress_init
        self.freeze_compress = bool(freeze_compress)
        self.local_window = int(local_window)
        self.local_count_once = bool(local_count_once)
        self.local_kernel = str(local_kernel)
        self.ffn_chunk_size = ffn_chunk_size
        self.initializer_range = initializer_range
        self.unk_token_id = unk_token_id
        self.mask_token_id = mask_token_id
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
