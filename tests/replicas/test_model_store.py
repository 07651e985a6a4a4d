import pytest
import torch

from specserve.replicas.model_store import (
    REFERENCE_TARGET,
    fetch_reference,
    load_causal_lm,
    resolve_dtype,
    resolve_model_path,
)
from tiny_models import tiny_model


def test_unknown_model_names_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_MODEL_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="specserve models fetch"):
        resolve_model_path("no-such-model")


def test_dtype_names():
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float8", torch.device("cpu"))


@pytest.mark.reference
def test_reference_target_is_cached_as_safetensors():
    path = fetch_reference()
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()


@pytest.mark.reference
def test_any_local_causal_lm_folder_loads(tmp_path):
    """A local Hugging Face folder (here a tiny random Qwen2 with the reference tokenizer)."""
    reference = load_causal_lm(REFERENCE_TARGET, dtype="float32")
    folder = tmp_path / "tiny-qwen2"
    tiny_model("qwen2", seed=0).save_pretrained(folder)
    reference.tokenizer.save_pretrained(folder)
    loaded = load_causal_lm(str(folder), dtype="bfloat16", device="cpu")
    assert loaded.model.config.model_type == "qwen2"
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.name == "tiny-qwen2"
