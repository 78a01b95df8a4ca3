"""Every yaml under configs/ composes with fairseq's hydra setup (as fairseq-hydra-train does)
and builds its model, shrunk in depth and width; the model gets the config's n, k and sharing."""

import ast
import re

import pytest
import torch
from fairseq import tasks
from fairseq.dataclass.initialize import add_defaults
from fairseq.modules import MultiheadAttention
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import linformer_fairseq  # noqa: F401  (registers linformer_roberta)
from linformer_fairseq.modules import LinformerMultiheadAttention
from linformer_tools.common import REPO
from linformer_tools.launch import compose  # the launchers' own composition

PRETRAINING, FINETUNING = REPO / "configs" / "pretraining", REPO / "configs" / "finetuning"
SHRINK = [
    "++model.encoder_layers=2",
    "++model.encoder_embed_dim=16",
    "++model.encoder_ffn_embed_dim=32",
    "++model.encoder_attention_heads=2",
]
LAYERS, HEADS = 2, 2
GLOBAL_BATCH = 2048  # RoBERTa-base's, see configs/pretraining/recipe.yaml


def primaries(folder):
    return sorted(p.stem for p in folder.glob("*.yaml") if p.stem not in ("recipe", "quickstart", "extend"))


def resolved(folder, name, overrides=()):
    """The config fairseq-hydra-train would run: composed, hydra values set, resolved."""
    cfg = compose(folder, name, overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # what hydra's app does: ${hydra:...} resolves
    try:
        add_defaults(cfg)
        del cfg["hydra"]
        container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    finally:
        HydraConfig.instance().cfg = None  # leave no hydra app behind for other tests
    return OmegaConf.create(container)


def build(cfg):
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    return task.build_model(cfg.model)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Dictionaries are all that building a model reads: masked_lm's and sentence_prediction's."""
    root = tmp_path_factory.mktemp("dicts")
    words = "".join(f"w{i} 1\n" for i in range(20))
    for folder, text in {".": words, "input0": words, "label": "0 1\n1 1\n2 1\n"}.items():
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "dict.txt").write_text(text)
    return root


def test_every_yaml_is_a_composed_config_or_a_group_of_one():
    """No stray yaml: each file is a primary config, the recipe, or an option of a group the
    recipe (or the command line, for run_config) selects."""
    groups = {"arch", "seq_len", "schedule", "metric", "truncation", "run_config"}
    for path in (REPO / "configs").rglob("*.yaml"):
        rel = path.relative_to(REPO / "configs")
        assert rel.parts[0] in ("pretraining", "finetuning"), rel
        assert len(rel.parts) == 2 or (len(rel.parts) == 3 and rel.parts[1] in groups), rel


@pytest.mark.parametrize("name", primaries(PRETRAINING))
def test_pretraining_config_builds_its_model(name, data):
    cfg = resolved(PRETRAINING, name, [f"task.data={data}"] + SHRINK)
    assert cfg.checkpoint.save_dir == f"checkpoints/{name}"
    # the paper's recipe, whatever the variant
    assert (cfg.task._name, cfg.criterion._name, cfg.optimizer._name) == ("masked_lm", "masked_lm", "adam")
    assert cfg.task.sample_break_mode == "complete"  # RoBERTa's FULL-SENTENCES
    assert (cfg.optimization.max_update, cfg.optimization.lr, cfg.lr_scheduler.warmup_updates) == (
        250000,
        [0.0005],
        10000,
    )
    assert ast.literal_eval(cfg.optimizer.adam_betas) == (0.9, 0.98) and cfg.optimizer.adam_eps == 1e-6
    assert cfg.optimizer.weight_decay == 0.01 and cfg.model.dropout == 0.1 and cfg.common.fp16
    world = cfg.distributed_training.distributed_world_size
    assert world == 64
    assert cfg.dataset.batch_size * cfg.optimization.update_freq[0] * world == GLOBAL_BATCH

    n = int(re.search(r"n(\d+)", name).group(1)) if name.startswith("linformer") else 512
    assert cfg.task.tokens_per_sample == cfg.model.max_positions == n
    model = build(cfg)
    attentions = [layer.self_attn for layer in model.encoder.sentence_encoder.layers]
    assert len(attentions) == LAYERS
    if name == "roberta_base":
        assert all(type(a) is MultiheadAttention for a in attentions)
        return
    k = int(re.search(r"_k(\d+)", name).group(1))
    window = int(re.search(r"_w(\d+)", name).group(1)) if "_w" in name else 0  # linformer_nN_kK[_SHARING][_wW]
    sharing = next((part for part in name.split("_")[3:] if not part.startswith("w")), "headwise")
    assert all(isinstance(a, LinformerMultiheadAttention) and a.local_window == window for a in attentions)
    if not window:  # weights over the band and the rows together are not returned
        x = torch.randn(n, 1, cfg.model.encoder_embed_dim)
        _, weights = attentions[0](query=x, key=x, value=x, need_weights=True, need_head_weights=True)
        assert weights.shape == (HEADS, 1, n, k)  # P-bar: n x k per head
    # the projections E (and F) are k x n matrices; how many exist is the sharing level; a band adds
    # one far-field offset per head
    cfg.model._name = "roberta"
    extra = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in build(cfg).parameters())
    projections = {"headwise": 2 * LAYERS, "kv": LAYERS, "layerwise": 1}[sharing] * k * n
    assert extra == projections + (LAYERS * HEADS if window else 0)


@pytest.mark.parametrize("name", primaries(FINETUNING))
def test_finetuning_config_builds_its_model(name, data):
    cfg = resolved(FINETUNING, name, [f"task.data={data}", "checkpoint.restore_file=pretrained.pt"] + SHRINK)
    assert cfg.checkpoint.save_dir == f"checkpoints/finetune/{name}/seed1"
    assert cfg.checkpoint.reset_optimizer and cfg.checkpoint.reset_dataloader and cfg.checkpoint.reset_meters
    assert cfg.task.max_positions == cfg.model.max_positions == 512
    assert (cfg.task._name, cfg.task.truncation) == (
        "long_sentence_prediction",
        "head_tail" if name in ("imdb", "long_documents") else "head",
    )
    metric = {"cola": "mcc", "sts_b": "pearson"}.get(name, "accuracy")
    assert cfg.checkpoint.best_checkpoint_metric == metric and cfg.checkpoint.maximize_best_checkpoint_metric
    classes = {"mnli": 3, "sts_b": 1}.get(name, 2)
    assert cfg.criterion.regression_target == (classes == 1)
    # fairseq's published per-task recipes are for one GPU; IMDB's is 8 x update_freq 4; long
    # documents are read whole, 2 in a step (its max_tokens is 2 x 4,096)
    assert cfg.dataset.batch_size * cfg.optimization.update_freq[0] == {
        "cola": 16,
        "mrpc": 16,
        "rte": 16,
        "sts_b": 16,
        "long_documents": 8,
    }.get(name, 32)
    if name == "long_documents":
        assert cfg.dataset.max_tokens == cfg.dataset.batch_size * 4096 and cfg.optimization.max_epoch == 2
        assert cfg.optimization.max_update == 0 and cfg.optimization.lr == [1e-4]
        assert cfg.model.freeze_compress == 1  # the recipe finetunes with E/F as pretrained
    assert cfg.model.pooler_tokens == ("mean" if name == "long_documents" else "first")
    model = build(cfg)
    assert all(
        isinstance(layer.self_attn, LinformerMultiheadAttention) for layer in model.encoder.sentence_encoder.layers
    )
    head = model.classification_heads["sentence_classification_head"]
    assert head.out_proj.out_features == classes


@pytest.mark.parametrize("folder", [PRETRAINING, FINETUNING], ids=["pretraining", "finetuning"])
def test_local_run_config_is_one_process(folder, data):
    name = primaries(folder)[0]
    cfg = resolved(folder, name, [f"task.data={data}", "+run_config=local"])
    assert cfg.distributed_training.distributed_world_size == 1 and cfg.common.log_interval == 1


def test_extend_config_continues_a_checkpoint_at_its_length(data):
    """extend.yaml with what scripts/pretrain.sh --from adds for a checkpoint at n' = 2048: the
    recipe at n', the short continued-pretraining schedule, a fresh optimizer and schedule."""
    model = ["++model._name=linformer_roberta", "++model.max_positions=2048", "++model.compressed_dim=256"]
    overrides = [f"task.data={data}", "checkpoint.restore_file=x.pt", "seq_len=n2048", "task.tokens_per_sample=2048"]
    cfg = resolved(PRETRAINING, "extend", overrides + model + SHRINK)
    assert (cfg.optimization.max_update, cfg.optimization.lr, cfg.lr_scheduler.warmup_updates) == (10000, [1e-4], 500)
    c = cfg.checkpoint
    assert c.restore_file == "x.pt" and c.reset_optimizer and c.reset_lr_scheduler and c.reset_dataloader
    assert cfg.task.tokens_per_sample == cfg.model.max_positions == 2048 and cfg.task.sample_break_mode == "none"
    assert (
        cfg.dataset.batch_size * cfg.optimization.update_freq[0] * cfg.distributed_training.distributed_world_size
        == GLOBAL_BATCH
    )
    x = torch.randn(2048, 1, cfg.model.encoder_embed_dim)
    attention = build(cfg).encoder.sentence_encoder.layers[0].self_attn
    _, weights = attention(query=x, key=x, value=x, need_weights=True, need_head_weights=True)
    assert weights.shape == (HEADS, 1, 2048, 256)


def test_quickstart_configs_build_the_small_models(data):
    pretrain = resolved(PRETRAINING, "quickstart", [f"task.data={data}"])
    model = build(pretrain)
    attentions = [layer.self_attn for layer in model.encoder.sentence_encoder.layers]
    assert len(attentions) == 2 and model.encoder.sentence_encoder.embed_positions.max_positions == 128
    assert all(a.compress_k.kind == "conv" and a.compress_k.k == 32 for a in attentions)
    baseline = build(resolved(PRETRAINING, "quickstart", [f"task.data={data}", "arch=roberta"]))
    assert type(baseline.encoder.sentence_encoder.layers[0].self_attn) is MultiheadAttention
    shapes = [{name: p.shape for name, p in m.named_parameters() if "compress" not in name} for m in (baseline, model)]
    assert shapes[0] == shapes[1]  # the same model but for the projections' kernels
    finetune = resolved(FINETUNING, "quickstart", [f"task.data={data}", "checkpoint.restore_file=x.pt"] + SHRINK)
    assert finetune.checkpoint.best_checkpoint_metric == "accuracy" and finetune.dataset.batch_size == 32


def test_hydra_name_of_the_large_architecture_builds_the_large_sizes(data):
    """fairseq-hydra-train merges a model's config defaults before any architecture function
    runs: `model._name: linformer_roberta_large` must still mean the large sizes."""
    name = "linformer_n512_k128_kv"
    cfg = resolved(
        PRETRAINING,
        name,
        [
            f"task.data={data}",
            "model._name=linformer_roberta_large",
            "~model.encoder_layers",
            "~model.encoder_embed_dim",
            "~model.encoder_ffn_embed_dim",
            "~model.encoder_attention_heads",
        ],
    )
    sizes = (
        cfg.model.encoder_layers,
        cfg.model.encoder_embed_dim,
        cfg.model.encoder_ffn_embed_dim,
        cfg.model.encoder_attention_heads,
    )
    assert sizes == (24, 1024, 4096, 16)
    assert (cfg.model.compressed_dim, cfg.model.compress_sharing) == (128, "kv")
