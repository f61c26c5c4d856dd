"""Tiny reward-model directories built offline (random-init sequence classifiers), shared by the
reward-model and preference tests."""

from __future__ import annotations

from pathlib import Path

import torch

# A different vocabulary from the embedded policy's (other order, letters for a chat template).
OTHER_ALPHABET = list("=-+9876543210|ua")
OTHER_TEMPLATE = "{% for m in messages %}|{{ m['role'][0] }}|{{ m['content'] }}{% endfor %}"


def other_tokenizer(chat_template: bool = True, special_tokens: bool = True):
    """A character tokenizer unlike the policy's: its own ids, optionally a chat template, and
    optionally no special tokens at all (no pad, no EOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = {"pad_token": "<|pad|>", "eos_token": "<|end|>", "unk_token": "<|unk|>"} if special_tokens else {}
    tokenizer = Tokenizer(models.WordLevel(unk_token=special.get("unk_token", "|")))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.train_from_iterator(["".join(OTHER_ALPHABET)],
                                  trainer=trainers.WordLevelTrainer(special_tokens=list(special.values())))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
    if chat_template:
        wrapped.chat_template = OTHER_TEMPLATE
    return wrapped


def save_classifier(directory: Path, tokenizer, *, arch: str = "llama", num_labels: int = 1,
                    max_positions: int = 64, seed: int = 0) -> Path:
    """A random-init ``*ForSequenceClassification`` and its tokenizer saved to ``directory``."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    if arch == "llama":
        model = LlamaForSequenceClassification(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
            pad_token_id=pad, num_labels=num_labels))
    else:
        model = GPT2ForSequenceClassification(GPT2Config(
            vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=max_positions,
            pad_token_id=pad, num_labels=num_labels))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)
