"""The policy's logits at the response positions, with each prompt computed once for all its responses.

A rollout batch repeats each of its B prompts for its n responses (``rollout.generate``), so a
forward pass over the B*n rows of prompt + response computes every prompt n times, although a
causal model's states at the prompt positions depend on the prompt alone. ``response_logits``
runs the B distinct prompts once, keeping their key/value cache, repeats the cache n times along
the batch (``DynamicCache.batch_repeat_interleave``, as generation does for beams) and runs only
the responses on top of it. The logits are the full forward's up to float rounding (about 1e-6,
as for KV-cached generation); gradients flow back through the repeated cache into the prompt
pass, so a loss on them has the full forward's gradient. It saves (n - 1) / n of the prompt
tokens' compute in every policy forward pass, and the vocabulary projection of the prompt
positions (``logits_to_keep``) in every pass. Generation takes the same repeated cache
(``prompt_cache``, used by ``rollout.generate``): it samples the same tokens.

Under DP each layer then runs twice per update, once on B prompt rows and once on B*n response
rows; ``per_sample.PerSampleGradients`` adds a prompt row's gradient to its prompt's (per row:
to its n rows in equal shares), so every prompt's gradient (what DP-SGD clips) is the full
forward's.

A batch whose rows do not come in groups of n identical prompts (n = 1, or rows picked one by
one) takes the full forward, and so does every pass with ``model.shared_prompt_cache = false``
(for a model whose cache cannot be repeated along the batch).
"""

from __future__ import annotations

import torch

from flwr_verl.engine._verl import compute_position_id_with_mask


def response_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, response_length: int, n: int) -> torch.Tensor:
    """Logits that predict each response token, (rows, R, V).

    ``input_ids``, ``attention_mask`` and ``position_ids`` are (rows, P + R): left-padded prompts
    followed by right-padded responses of length R = ``response_length``; rows come in groups of
    ``n`` adjacent rows with the same prompt when the batch was rolled out with n responses each.
    """
    prompt_length = input_ids.shape[1] - response_length
    if not _grouped(input_ids[:, :prompt_length], attention_mask[:, :prompt_length], n):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False, logits_to_keep=response_length + 1).logits[:, :-1]
    last_logits, cache = _prompt_pass(model, input_ids[::n, :prompt_length], attention_mask[::n, :prompt_length],
                                      position_ids[::n, :prompt_length], n)
    responses = model(input_ids=input_ids[:, prompt_length:], attention_mask=attention_mask,
                      position_ids=position_ids[:, prompt_length:], past_key_values=cache, use_cache=True).logits
    # the prompt's last position predicts the first response token; each response position the next
    return torch.cat([last_logits, responses[:, :-1]], dim=1)


@torch.no_grad()
def prompt_cache(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int):
    """The key/value cache of B distinct left-padded prompts (B, P), computed once and repeated
    for n responses each, row b's for rows b*n .. b*n + n - 1: what ``model.generate`` takes as
    ``past_key_values`` for the B*n repeated prompts (it then runs only their uncached tokens)."""
    return _prompt_pass(model, prompt_ids, prompt_mask, compute_position_id_with_mask(prompt_mask), n)[1]


def _prompt_pass(model, prompt_ids, prompt_mask, position_ids, n: int):
    """The prompts' last-position logits (B*n, 1, V) and their cache, each repeated n times along the batch."""
    output = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True,
                   logits_to_keep=1)
    cache = output.past_key_values
    cache.batch_repeat_interleave(n)
    return output.logits.repeat_interleave(n, dim=0), cache


def _grouped(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int) -> bool:
    """Whether the rows come in groups of ``n`` >= 2 adjacent rows that share one prompt."""
    rows, length = prompt_ids.shape
    if n < 2 or length == 0 or rows % n:
        return False
    return all(torch.equal(t.view(rows // n, n, length), t[::n, None].expand(rows // n, n, length))
               for t in (prompt_ids, prompt_mask))
