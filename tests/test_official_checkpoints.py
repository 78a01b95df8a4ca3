"""Checkpoints written by the original fairseq Linformer example (examples/linformer) load
through fairseq's own loader, under torch's safe (weights_only) unpickler, and reproduce the
outputs that code computed (fixtures and their provenance: tests/fixtures/official-linformer)."""

from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils

import linformer_fairseq  # noqa: F401  (registers the model, allow-lists argparse.Namespace)

FIXTURES = Path(__file__).parent / "fixtures" / "official-linformer"


@pytest.mark.parametrize("sharing", ["headwise", "kv", "layerwise"])
def test_official_checkpoint_reproduces_expected_outputs(sharing):
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(FIXTURES / sharing / "model.pt")], arg_overrides={"data": str(FIXTURES)}
    )
    model = models[0].eval()
    assert model.encoder.sentence_encoder.linformer.sharing == sharing
    expected = torch.load(FIXTURES / sharing / "expected_outputs.pt")
    for length in (64, 40):
        src = expected[f"tokens_{length}"]
        with torch.no_grad():
            logits, _ = model(src)
            feats, _ = model(src, features_only=True)
        torch.testing.assert_close(logits, expected[f"logits_{length}"], atol=1e-5, rtol=0)
        torch.testing.assert_close(feats, expected[f"features_{length}"], atol=1e-5, rtol=0)
