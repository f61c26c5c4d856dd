"""Serving a finished run's policy with the generation-time filter of ``privacy.deidentify``:
the global adapter on its base, and a logits processor that keeps protected text out of its
outputs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from transformers import LogitsProcessorList

from flwr_verl.config import ModelConfig
from flwr_verl.engine.models import load_tokenizer, resolve_model_path
from flwr_verl.privacy.deidentify import NoVerbatimNgrams, ProtectedNgrams


def deidentified_generation(run_dir: str | Path, texts: Iterable[str], *, ngram: int | None = None,
                            false_positive_rate: float | None = None, adapter: str = "final", device: str = "cpu"):
    """Serving API: the global policy of a run, and the processor that keeps ``texts`` out of
    its outputs.

    Returns ``(model, tokenizer, logits_processor)``: the base model of the run's config with
    the PEFT adapter ``<run_dir>/adapters/<adapter>/policy`` loaded, its tokenizer, and a
    ``LogitsProcessorList`` to pass to ``model.generate(..., logits_processor=...)``. ``ngram``
    and ``false_positive_rate`` default to the run's ``deidentify.*`` values::

        model, tokenizer, processors = deidentified_generation("runs/run-...", my_private_texts)
        out = model.generate(**tokenizer(["..."], return_tensors="pt"), logits_processor=processors)
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = Path(run_dir).expanduser()
    adapter_dir = run_dir / "adapters" / adapter / "policy"
    if not adapter_dir.is_dir():
        raise FileNotFoundError(f"{adapter_dir} is not a PEFT adapter directory (is {run_dir} a flwr-verl run?)")
    saved = json.loads((run_dir / "config.json").read_text())["engine"]
    model_config = ModelConfig(**saved["model"])
    options = saved.get("deidentify", {})
    ngram = options.get("ngram", 6) if ngram is None else ngram
    false_positive_rate = options.get("false_positive_rate", 1e-4) if false_positive_rate is None \
        else false_positive_rate
    path = resolve_model_path(model_config)
    tokenizer = load_tokenizer(path)
    base = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).to(device).eval()
    protected = ProtectedNgrams.from_texts(tokenizer, texts, ngram=ngram, false_positive_rate=false_positive_rate)
    return model, tokenizer, LogitsProcessorList([NoVerbatimNgrams(protected)])
