import pytest
import torch

from specserve.replicas.model_store import (
    REFERENCE_TARGET,
    fetch_reference,
    load_causal_lm,
    quantized_name,
    resolve_dtype,
    resolve_model_path,
)
from specserve.replicas.model import int8_linear, llama_forward
from specserve.replicas.model.llama_forward import quantization
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


def tiny_folder(tmp_path, arch: str):
    """A local Hugging Face folder: a tiny random model with the reference tokenizer."""
    folder = tmp_path / f"tiny-{arch}"
    tiny_model(arch, seed=0).save_pretrained(folder)
    load_causal_lm(REFERENCE_TARGET, dtype="float32").tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.reference
def test_any_local_causal_lm_folder_loads(tmp_path):
    """A local Hugging Face folder (here a tiny random Qwen2 with the reference tokenizer)."""
    folder = tiny_folder(tmp_path, "qwen2")
    loaded = load_causal_lm(str(folder), dtype="bfloat16", device="cpu")
    assert loaded.model.config.model_type == "qwen2"
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.name == "tiny-qwen2"


def test_a_quantized_draft_is_named_as_such_and_a_quantization_not_known_is_refused(tmp_path):
    assert quantized_name("smollm2-eagle3-int8") == ("smollm2-eagle3", "int8")
    assert quantized_name("smollm2-eagle3") == ("smollm2-eagle3", None)
    with pytest.raises(ValueError, match="one of None, int8"):
        load_causal_lm(str(tmp_path / "anything"), quantization="int4")


@pytest.mark.reference
def test_a_draft_loaded_with_int8_runs_its_products_on_int8_rows(tmp_path):
    folder = tiny_folder(tmp_path, "llama")
    plain = load_causal_lm(str(folder), dtype="float32")
    assert quantization(plain.model) is None
    loaded = load_causal_lm(str(folder), dtype="float32", quantization="int8")
    assert quantization(loaded.model) == "int8"
    assert (llama_forward.for_model(loaded.model).lm_head.int8 is not None) == (int8_linear.library() is not None)
