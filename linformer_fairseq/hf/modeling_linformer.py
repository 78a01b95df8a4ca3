"""A Linformer (Wang et al. 2020) pretrained with the linformer-fairseq plugin, as Hugging Face
transformers models: ``LinformerModel`` (the encoder), ``LinformerForMaskedLM`` and
``LinformerForSequenceClassification`` (classification or regression).

Depends only on torch and transformers. The attention (the sequence projections E/F and the
attention over the k projected keys and values) is ``linformer_attention.py`` beside this file, with
the files it imports, the plugin's own modules copied byte for byte by ``scripts/export_hf.py``: the
fairseq model and this one run the same code. The rest is fairseq's RoBERTa encoder: token embeddings, learned
positions starting at pad + 1, post-norm layers (or pre-norm with a final layer norm),
fairseq's masked-LM head (tied to the token embedding) and classification head (on ``<s>``).

Inputs must be right-padded (transformers' default padding side): the projections tie E's
columns to positions. A fairseq RoBERTa exports to the same classes with ``attention="full"``.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput

from .configuration_linformer import LinformerConfig
from .linformer_attention import LinformerMultiheadAttention, LinformerSettings, attend, projection


def _gelu_accurate(x: Tensor) -> Tensor:
    """fairseq's gelu_accurate (the tanh approximation), as fairseq computes it."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


# fairseq.utils.get_activation_fn's functions
ACTIVATIONS = {
    "relu": F.relu,
    "relu_squared": lambda x: F.relu(x).pow(2),
    "gelu": F.gelu,
    "gelu_fast": _gelu_accurate,
    "gelu_accurate": _gelu_accurate,
    "tanh": torch.tanh,
    "linear": lambda x: x,
    "swish": F.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _tracing() -> bool:
    """Under torch.compile, torch.export or jit tracing: checks that read tensor values are skipped there."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None:
        if compiler.is_compiling() or getattr(compiler, "is_exporting", lambda: False)():
            return True
    return torch.jit.is_tracing()


def linformer_settings(config: LinformerConfig) -> LinformerSettings:
    return LinformerSettings(
        max_positions=config.max_positions,
        compressed_dims=tuple(config.compressed_dims),
        sharing=config.compress_sharing,
        kind=config.compress_type,
        length_norm=config.compress_length_norm,
        init=config.compress_init,
        freeze=config.freeze_compress,
        ffn_chunk_size=config.ffn_chunk_size,
        local_window=getattr(config, "local_window", 0),  # folders exported before the band have none
        local_count_once=getattr(config, "local_count_once", False),
        local_kernel=getattr(config, "local_kernel", "auto"),
    )


class FullSelfAttention(nn.Module):
    """fairseq's MultiheadAttention as a RoBERTa's encoder uses it (self-attention, key padding
    mask), with LinformerMultiheadAttention's signature: ``T x B x C`` in and out."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key_padding_mask=None, need_weights=False, need_head_weights=False, **unused):
        T, B, C = query.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = (proj(query).view(T, B, H, D).permute(1, 2, 0, 3) for proj in (self.q_proj, self.k_proj, self.v_proj))
        mask = None if key_padding_mask is None else ~key_padding_mask.view(B, 1, 1, T)
        out, weights = attend(q, k, v, mask, self.dropout if self.training else 0.0, need_weights, need_head_weights)
        return self.out_proj(out.permute(2, 0, 1, 3).reshape(T, B, C)), weights


class LinformerLayer(nn.Module):
    """fairseq's TransformerEncoderLayer with Linformer (or full) self-attention; ``T x B x C``."""

    def __init__(self, config: LinformerConfig, layer_idx: int, settings: LinformerSettings | None, shared=None):
        super().__init__()
        C = config.hidden_size
        if config.attention == "full":
            self.self_attn = FullSelfAttention(C, config.num_attention_heads, config.attention_probs_dropout_prob)
        else:
            self.self_attn = LinformerMultiheadAttention(
                C,
                config.num_attention_heads,
                settings,
                settings.compressed_dims[layer_idx],
                dropout=config.attention_probs_dropout_prob,
                shared_projection=shared,
            )
            if shared is not None:
                # the layerwise projection is registered once, in the encoder (compress_layer): every
                # layer reaches it, and its weight is saved and loaded under that one name
                del self.self_attn._modules["compress_k"]
                self.self_attn.__dict__["compress_k"] = shared
        self.self_attn_layer_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(C, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, C)
        self.final_layer_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.activation_fn = activation(config.hidden_act)
        self.dropout, self.activation_dropout = config.hidden_dropout_prob, config.activation_dropout
        self.normalize_before = config.normalize_before
        self.ffn_chunk_size = config.ffn_chunk_size

    def feed_forward_block(self, x: Tensor) -> Tensor:
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = F.dropout(self.activation_fn(self.fc1(x)), self.activation_dropout, self.training)
        x = residual + F.dropout(self.fc2(x), self.dropout, self.training)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x

    def forward(self, x: Tensor, pad_mask: Tensor | None, output_attentions: bool = False):
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, weights = self.self_attn(query=x, key_padding_mask=pad_mask, need_head_weights=output_attentions)
        x = residual + F.dropout(x, self.dropout, self.training)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        chunk = self.ffn_chunk_size
        if chunk > 0 and not self.training and x.size(0) > chunk:  # position-wise: same outputs, less memory
            return torch.cat([self.feed_forward_block(x[s : s + chunk]) for s in range(0, x.size(0), chunk)]), weights
        return self.feed_forward_block(x), weights


class LinformerLMHead(nn.Module):
    """fairseq's RobertaLMHead: dense, activation, layer norm, then the (tied) output matrix and a bias."""

    def __init__(self, config: LinformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.activation_fn = activation(config.hidden_act)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        if config.untie_weights_roberta:
            self.weight = nn.Parameter(torch.zeros(config.vocab_size, config.hidden_size))
        else:
            self.register_parameter("weight", None)

    def forward(self, features: Tensor, embedding_weight: Tensor) -> Tensor:
        x = self.layer_norm(self.activation_fn(self.dense(features)))
        return F.linear(x, embedding_weight if self.weight is None else self.weight) + self.bias


class LinformerClassificationHead(nn.Module):
    """fairseq's RobertaClassificationHead, on the first token (<s>) or, with
    ``classifier_pooling="mean"``, on the mean of the real tokens' states."""

    def __init__(self, config: LinformerConfig):
        super().__init__()
        inner = config.classifier_inner_dim or config.hidden_size
        self.dense = nn.Linear(config.hidden_size, inner)
        self.out_proj = nn.Linear(inner, config.num_labels)
        self.activation_fn = activation(config.classifier_activation)
        self.dropout = config.classifier_dropout
        self.pooling = config.classifier_pooling

    def forward(self, features: Tensor, real: Tensor | None = None) -> Tensor:
        """features: ``B x T x C``; real: ``B x T``, False at padding (default: every token)."""
        if self.pooling == "mean":
            real = torch.ones_like(features[..., 0], dtype=torch.bool) if real is None else real
            weights = real.unsqueeze(-1).to(features)
            x = (features * weights).sum(1) / weights.sum(1)
        else:
            x = features[:, 0, :]
        x = F.dropout(x, self.dropout, self.training)
        x = F.dropout(self.activation_fn(self.dense(x)), self.dropout, self.training)
        return self.out_proj(x)


class LinformerPreTrainedModel(PreTrainedModel):
    config_class = LinformerConfig
    config: LinformerConfig
    base_model_prefix = "linformer"
    _no_split_modules = ["LinformerLayer"]

    def _init_weights(self, module):
        """fairseq's init_bert_params for new weights (e.g. a new classification head); projections
        keep the init of their own kind."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, LinformerLMHead):
            nn.init.zeros_(module.bias)
            if module.weight is not None:
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def freeze_projections(self):
        """Keep the projections out of training, as --freeze-compress 1 does (loading creates new parameters)."""
        if self.config.freeze_compress:
            for module in self.modules():
                if isinstance(module, LinformerMultiheadAttention):
                    for p in module.compress_parameters():
                        p.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        loaded = super().from_pretrained(*args, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).freeze_projections()
        return loaded

    def _return_dict(self, return_dict):
        if return_dict is not None:
            return return_dict
        return getattr(self.config, "return_dict", True)


class LinformerModel(LinformerPreTrainedModel):
    """The encoder: ``last_hidden_state`` is fairseq's ``features_only`` output (B x T x C)."""

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.", r"^classifier\."]

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        C, pad = config.hidden_size, config.pad_token_id
        self.padding_idx = pad
        self.embed_tokens = nn.Embedding(config.vocab_size, C, padding_idx=pad)
        self.embed_positions = nn.Embedding(config.max_positions + pad + 1, C, padding_idx=pad)
        self.layernorm_embedding = nn.LayerNorm(C, eps=config.layer_norm_eps) if config.layernorm_embedding else None
        settings, shared = None, None
        if config.attention == "linformer":
            settings = linformer_settings(config)  # checks k, sharing, kind, length norm
            if settings.sharing == "layerwise":
                self.compress_layer = shared = projection(settings, settings.compressed_dims[0])
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(LinformerLayer(config, i, settings, shared) for i in layers)
        self.layer_norm = nn.LayerNorm(C, eps=config.layer_norm_eps) if config.normalize_before else None
        self.post_init()
        self.freeze_projections()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,  # not used: fairseq's RoBERTa has no segment embedding
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """input_ids: ``B x T``, right-padded; attention_mask: 1 at real tokens (default: the
        tokens that are not ``<pad>``); position_ids: default fairseq's, pad + 1 + the token's index."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        B, T = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        n = self.config.max_positions
        if T > n:
            raise ValueError(f"input of length {T} is longer than max_positions {n}; truncate it (truncation=True)")
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if attention_mask is not None:
            real = attention_mask.to(device).bool()
        elif input_ids is not None:
            real = input_ids.ne(self.padding_idx)
        else:
            real = torch.ones(B, T, dtype=torch.bool, device=device)
        tracing = _tracing()
        if not tracing and (~real[:, 0].all() or (real[:, 1:] & ~real[:, :-1]).any()):
            raise ValueError(
                "Linformer needs right-padded inputs (the projection ties E's columns to positions): got padding "
                "before a real token (tokenizer.padding_side must be 'right')"
            )
        if position_ids is None:
            position_ids = torch.cumsum(real, dim=1) * real + self.padding_idx
        embedded = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = self.config.embed_scale * embedded + self.embed_positions(position_ids)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = F.dropout(x, self.config.hidden_dropout_prob, self.training)
        x = x * real.unsqueeze(-1).type_as(x)
        pad_mask = ~real
        if not tracing and not pad_mask.any():
            pad_mask = None  # as fairseq: a batch without padding runs without a mask

        x = x.transpose(0, 1)  # T x B x C, as the layers take it
        hidden_states = (x.transpose(0, 1),) if output_hidden_states else None
        attentions = () if output_attentions else None
        for layer in self.layers:
            x, weights = layer(x, pad_mask, output_attentions=bool(output_attentions))
            if output_hidden_states:
                hidden_states += (x.transpose(0, 1),)
            if output_attentions:
                attentions += (weights.transpose(0, 1),)  # B x H x T x k' (T x T with full attention)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if not self._return_dict(return_dict):
            return tuple(v for v in (x, hidden_states, attentions) if v is not None)
        return BaseModelOutput(last_hidden_state=x, hidden_states=hidden_states, attentions=attentions)


class LinformerForMaskedLM(LinformerPreTrainedModel):
    """The encoder and fairseq's masked-LM head: ``logits`` are fairseq's ``model(tokens)[0]``."""

    _keys_to_ignore_on_load_unexpected = [r"^classifier\."]

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        self.linformer = LinformerModel(config)
        self.lm_head = LinformerLMHead(config)
        self.post_init()
        self.freeze_projections()

    def get_input_embeddings(self):
        return self.linformer.embed_tokens

    def set_input_embeddings(self, value):
        self.linformer.embed_tokens = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """labels: ``B x T`` token ids to predict, -100 where there is nothing to predict."""
        outputs = self.linformer(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.lm_head(outputs.last_hidden_state, self.linformer.embed_tokens.weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.to(logits.device).view(-1))
        if not self._return_dict(return_dict):
            rest = tuple(v for v in (outputs.hidden_states, outputs.attentions) if v is not None)
            return ((loss,) if loss is not None else ()) + (logits,) + rest
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class LinformerForSequenceClassification(LinformerPreTrainedModel):
    """The encoder and fairseq's classification head (sentence_prediction): one score per label,
    or one value with ``num_labels=1`` (regression, ``problem_type="regression"``)."""

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: LinformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.linformer = LinformerModel(config)
        self.classifier = LinformerClassificationHead(config)
        self.post_init()
        self.freeze_projections()

    def get_input_embeddings(self):
        return self.linformer.embed_tokens

    def set_input_embeddings(self, value):
        self.linformer.embed_tokens = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """labels: class ids (``B``), or targets (``B`` floats) for regression."""
        outputs = self.linformer(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        if attention_mask is not None:
            real = attention_mask.bool()
        else:
            real = input_ids.ne(self.config.pad_token_id) if input_ids is not None else None
        logits = self.classifier(outputs.last_hidden_state, real)
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            problem = self.config.problem_type
            if problem is None:
                if self.num_labels == 1:
                    problem = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    problem = "single_label_classification"
                else:
                    problem = "multi_label_classification"
                self.config.problem_type = problem
            if problem == "regression":
                target = labels.to(logits.dtype)
                loss = (
                    F.mse_loss(logits.squeeze(-1), target.view(-1))
                    if self.num_labels == 1
                    else F.mse_loss(logits, target)
                )
            elif problem == "single_label_classification":
                loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        if not self._return_dict(return_dict):
            rest = tuple(v for v in (outputs.hidden_states, outputs.attentions) if v is not None)
            return ((loss,) if loss is not None else ()) + (logits,) + rest
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


__all__ = ["LinformerForMaskedLM", "LinformerForSequenceClassification", "LinformerModel", "LinformerPreTrainedModel"]
