"""TRL's side of tests/stages/test_dpo.py, run with the TRL venv's python (never imported by the project).

Reads a JSON list of cases from stdin, each {"loss_type", "beta", "label_smoothing", "sft_weight",
"per_token": [[...]] (2P rows of the policy's per-token log-probs, 0 off the completion), "mask":
[[...]] (2P rows, completion tokens), "ref_chosen": [...], "ref_rejected": [...]}. Runs TRL 1.16's
``DPOTrainer._compute_loss`` on exactly those log-probs (a model stub returns them; the reference
log-probs come precomputed, as with ``precompute_ref_log_probs``), with TRL's "sft" loss added
at weight ``sft_weight`` when it is not 0, and prints the list of losses.
"""

import json
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from trl import DPOTrainer


def trl_loss(spec: dict) -> float:
    per_token = torch.tensor(spec["per_token"], dtype=torch.float64)
    mask = torch.tensor(spec["mask"], dtype=torch.long)
    rows, width = per_token.shape  # width = T - 1 (shifted), so inputs have T columns

    def model(**_kwargs):
        zeros = torch.zeros(rows, width, dtype=torch.float64)
        return SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros,
                               is_top1=torch.zeros(rows, width, dtype=torch.bool))

    model.training = True
    losses = {"loss_types": [spec["loss_type"]], "loss_weights": [1.0]}
    if spec["sft_weight"]:
        losses = {"loss_types": [spec["loss_type"], "sft"], "loss_weights": [1.0, spec["sft_weight"]]}
    trainer = DPOTrainer.__new__(DPOTrainer)  # only the loss: no model, data or optimizer
    trainer.__dict__.update(
        model=model, accelerator=Accelerator(cpu=True), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", **losses,
        beta=spec["beta"], label_smoothing=spec["label_smoothing"], use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    completion_mask = torch.cat([torch.zeros(rows, 1, dtype=torch.long), mask], dim=1)
    inputs = {"input_ids": torch.zeros(rows, width + 1, dtype=torch.long), "attention_mask": torch.ones_like(completion_mask),
              "completion_mask": completion_mask,
              "ref_chosen_logps": torch.tensor(spec["ref_chosen"], dtype=torch.float64),
              "ref_rejected_logps": torch.tensor(spec["ref_rejected"], dtype=torch.float64)}
    return float(DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False))


def main() -> None:
    print(json.dumps([trl_loss(spec) for spec in json.load(sys.stdin)]))


if __name__ == "__main__":
    main()
