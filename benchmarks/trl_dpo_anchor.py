"""TRL's side of ``benchmarks/dpo.py``: centralized DPO with TRL 1.16's ``DPOTrainer``, no DP, run
with the peer venv's python (``../shared/peer/README.md``: torch, trl, peft), never imported by the
project. It trains a LoRA adapter on the pooled training pairs and saves it; ``dpo.py`` scores it
exactly as it scores the federated one.

    <trl-venv>/bin/python benchmarks/trl_dpo_anchor.py SPEC.json

SPEC: {"model": dir, "pairs": jsonl of {"prompt", "chosen", "rejected"}, "out": dir, "beta",
"epochs", "lr", "batch_size", "lora_rank", "seed", "sft_weight"}: with ``sft_weight`` > 0 the loss is
TRL's ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, sft_weight]``, as stage dpo's
``dpo.sft_weight``.
"""

import json
import sys
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

spec = json.loads(open(sys.argv[1]).read())
torch.manual_seed(spec["seed"])
torch.set_num_threads(1)
tokenizer = AutoTokenizer.from_pretrained(spec["model"])
model = AutoModelForCausalLM.from_pretrained(spec["model"])
pairs = [json.loads(line) for line in open(spec["pairs"])]
losses = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, spec["sft_weight"]]} if spec["sft_weight"] else {}
args = DPOConfig(output_dir=spec["out"] + "/trainer", beta=spec["beta"], num_train_epochs=spec["epochs"],
                 learning_rate=spec["lr"], per_device_train_batch_size=spec["batch_size"], seed=spec["seed"],
                 report_to=[], logging_steps=50, save_strategy="no", use_cpu=True, bf16=False, **losses)
lora = LoraConfig(r=spec["lora_rank"], lora_alpha=2 * spec["lora_rank"], target_modules="all-linear",
                  task_type="CAUSAL_LM")
trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tokenizer,
                     peft_config=lora)
started = time.perf_counter()
trainer.train()
trainer.model.save_pretrained(spec["out"] + "/policy")
print(json.dumps({"seconds": time.perf_counter() - started, "pairs": len(pairs)}))
