"""Rollout: sample responses with Hugging Face ``generate`` and pack them as a verl ``DataProto``.

verl's own rollout workers need a GPU inference engine (vLLM, SGLang); this is the thin CPU/GPU
layer that produces the same batch layout verl's trainers consume::

    prompts        (B*n, P)    left-padded prompt ids
    responses      (B*n, R)    response ids, right-padded to R = rollout.response_length
    input_ids      (B*n, P+R)  prompts ++ responses
    attention_mask (B*n, P+R)  1 on real prompt tokens and on response tokens up to EOS
    position_ids   (B*n, P+R)
    response_mask  (B*n, R)    1 up to and including the first EOS
    non-tensor: data_source, reward_model, extra_info, uid (one uid per prompt: the group),
                raw_prompt (the prompt's messages, as verl's ``return_raw_chat``)

Rows are repeated with ``interleave=True``: the n responses of one prompt are adjacent.
"""

from __future__ import annotations

import numpy as np
import torch

from flwr_verl.config import RolloutConfig
from flwr_verl.engine._verl import DataProto, compute_position_id_with_mask, compute_response_mask, verl_F
from flwr_verl.engine.data import Row, prompt_text
from flwr_verl.engine.forward import prompt_cache
from flwr_verl.engine.rewards import PROMPT_KEY


@torch.no_grad()
def generate(
    model,
    tokenizer,
    rows: list[Row],
    config: RolloutConfig,
    max_prompt_length: int,
    *,
    n: int | None = None,
    greedy: bool = False,
    uid_offset: int = 0,
    logits_processor=None,
    shared_prompt_cache: bool = True,
) -> DataProto:
    """``n`` (default ``config.n``) responses for each of ``rows``; ``logits_processor`` goes to
    ``generate`` as is (``deidentify.build_processors``). With ``shared_prompt_cache`` each
    prompt is computed once and its key/value cache repeated for its n responses
    (``forward.prompt_cache``): the same tokens, for 1/n of the prompts' compute."""
    n = config.n if n is None else n
    device = next(model.parameters()).device
    texts = [prompt_text(row, tokenizer) for row in rows]
    tokenizer.truncation_side = "left"  # keep the end of an overlong prompt: it holds the question
    encoded = tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                        max_length=max_prompt_length, add_special_tokens=False)
    prompt_ids = encoded["input_ids"].repeat_interleave(n, dim=0).to(device)
    prompt_mask = encoded["attention_mask"].repeat_interleave(n, dim=0).to(device)

    sampling = {"do_sample": False} if greedy else {
        "do_sample": True, "temperature": config.temperature, "top_p": config.top_p,
        "top_k": config.top_k or None,
    }
    model.eval()
    cache = None
    if shared_prompt_cache and n > 1 and encoded["input_ids"].shape[1] > 1:
        # all but the last prompt token: generate's first step runs that one on the cache
        cache = prompt_cache(model, encoded["input_ids"][:, :-1].to(device), encoded["attention_mask"][:, :-1].to(device), n)
    output = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=config.response_length,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, logits_processor=logits_processor,
        past_key_values=cache, **sampling,
    )
    responses = output[:, prompt_ids.shape[1]:]
    pad = config.response_length - responses.shape[1]  # generation may stop early for all rows
    responses = torch.nn.functional.pad(responses, (0, pad), value=tokenizer.pad_token_id)
    # verl's mask: 1 up to and including the first EOS, 0 after it
    response_mask = verl_F.get_response_mask(responses, eos_token=tokenizer.eos_token_id, dtype=prompt_mask.dtype)
    responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = compute_position_id_with_mask(attention_mask)
    repeated = [row for row in rows for _ in range(n)]
    batch = DataProto.from_single_dict({
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "data_source": np.array([row["data_source"] for row in repeated], dtype=object),
        "reward_model": np.array([row["reward_model"] for row in repeated], dtype=object),
        "extra_info": np.array([{**row.get("extra_info", {}), PROMPT_KEY: text}
                                for row, text in zip(repeated, [t for t in texts for _ in range(n)])], dtype=object),
        "uid": np.repeat(np.arange(uid_offset, uid_offset + len(rows)), n).astype(object),
        "raw_prompt": _object_array([row["prompt"] for row in repeated]),  # messages, for a reward model
    })
    batch.batch["response_mask"] = compute_response_mask(batch)
    return batch


def _object_array(items: list) -> np.ndarray:
    """A 1-D object array of ``items`` (``np.array`` would turn lists of messages into a 2-D array)."""
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array
