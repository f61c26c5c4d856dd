"""Generation-time de-identification (MemFree decoding): what the filter blocks, and what not."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from flwr_verl.config import ConfigError, parse_run_config
from flwr_verl.engine.data import load_rows, prompt_text
from flwr_verl.engine.models import build_models
from flwr_verl.engine.rollout import generate
from flwr_verl.engine.trainer import LocalPPOTrainer
from flwr_verl.federation.client import with_node_corpus
from flwr_verl.privacy.deidentify import CorpusError, NoVerbatimNgrams, ProtectedNgrams, build_processors, read_corpus

NGRAM = 4


@pytest.fixture(scope="module")
def models(tiny_config):
    return build_models(tiny_config().model, with_critic=False)


@pytest.fixture(scope="module")
def val_rows(tiny_config):
    return load_rows(tiny_config().data, "val", seed=0)


def _ngrams(ids, n):
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def _emitted_ngrams(batch, n):
    """The n-grams whose last token is a generated one (prompt context included), up to EOS."""
    found = set()
    prompts, responses, mask = batch.batch["prompts"], batch.batch["responses"], batch.batch["response_mask"]
    for prompt, response, keep in zip(prompts.tolist(), responses.tolist(), mask.tolist()):
        sequence = prompt + [t for t, k in zip(response, keep) if k]
        found |= {tuple(sequence[i - n + 1:i + 1]) for i in range(max(len(prompt), n - 1), len(sequence))}
    return found


def _generate(models, rows, config, processors, seed, greedy=False):
    torch.manual_seed(seed)
    return generate(models.policy, models.tokenizer, rows, config.rollout, config.data.max_prompt_length,
                    n=4, greedy=greedy, logits_processor=processors)


def test_bloom_filter_has_no_false_negatives_and_about_its_false_positive_rate():
    rng = torch.Generator().manual_seed(0)
    corpus = torch.randint(0, 1000, (50, 40), generator=rng).tolist()
    protected = ProtectedNgrams.from_token_ids(corpus, ngram=5, false_positive_rate=0.01)
    inserted = torch.tensor(sorted({g for s in corpus for g in _ngrams(s, 5)}))
    assert protected.contains(inserted).all()
    strangers = torch.randint(1000, 2000, (20_000, 5), generator=rng)  # tokens never in the corpus
    assert protected.contains(strangers).float().mean().item() < 0.02
    assert protected.ngrams.bits.numel() / protected.num_ngrams == pytest.approx(9.585, rel=0.01)  # -ln p/ln(2)^2


def test_sampled_generations_never_emit_a_protected_ngram(models, val_rows, tiny_config):
    """Protect what the model itself writes: unfiltered it reproduces it, filtered never."""
    config = tiny_config(rollout={"response_length": 8, "temperature": 1.0})
    tokenizer, rows = models.tokenizer, val_rows[:16]
    answers = [row["prompt"][0]["content"] + row["reward_model"]["ground_truth"] for row in val_rows]
    protected_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    protected = {g for ids in protected_ids for g in _ngrams(ids, NGRAM)}
    processors = LogitsProcessorList([NoVerbatimNgrams(
        ProtectedNgrams.from_token_ids(protected_ids, ngram=NGRAM, false_positive_rate=1e-3))])
    unfiltered = filtered = 0
    for seed in range(8):  # 8 x 16 prompts x 4 samples
        unfiltered += len(_emitted_ngrams(_generate(models, rows, config, None, seed), NGRAM) & protected)
        filtered += len(_emitted_ngrams(_generate(models, rows, config, processors, seed), NGRAM) & protected)
    assert unfiltered > 0  # the filter had something to block
    assert filtered == 0


def test_an_empty_corpus_changes_nothing(models, val_rows, tiny_config):
    config = tiny_config()
    processors = LogitsProcessorList([NoVerbatimNgrams(ProtectedNgrams.from_texts(models.tokenizer, []))])
    for greedy in (True, False):
        plain = _generate(models, val_rows[:8], config, None, seed=3, greedy=greedy)
        empty = _generate(models, val_rows[:8], config, processors, seed=3, greedy=greedy)
        assert torch.equal(plain.batch["responses"], empty.batch["responses"])


def test_filter_and_filtered_generation_are_deterministic(models, val_rows, tiny_config):
    config = tiny_config()
    texts = [prompt_text(row, models.tokenizer) for row in val_rows]
    first, second = (ProtectedNgrams.from_texts(models.tokenizer, texts, ngram=3) for _ in range(2))
    assert torch.equal(first.ngrams.bits, second.ngrams.bits) and torch.equal(first.prefixes.bits, second.prefixes.bits)
    runs = [_generate(models, val_rows[:8], config, LogitsProcessorList([NoVerbatimNgrams(first)]), seed=5)
            for _ in range(2)]
    assert torch.equal(runs[0].batch["responses"], runs[1].batch["responses"])


def test_evaluation_applies_the_filter_of_the_corpus_file(tmp_path, models, val_rows, tiny_config):
    """With the val answers as protected text, the trainer's evaluation may not write them."""
    corpus = tmp_path / "protected.txt"
    corpus.write_text("\n".join(row["prompt"][0]["content"] + row["reward_model"]["ground_truth"]
                                for row in val_rows))
    rows = val_rows[:16]
    plain = LocalPPOTrainer(tiny_config(), rows, models=models).evaluate(rows)
    config = tiny_config(deidentify={"enabled": True, "protect_prompts": False, "corpus_file": str(corpus),
                                     "ngram": NGRAM})
    filtered = LocalPPOTrainer(config, rows, models=models).evaluate(rows)
    assert plain.accuracy >= 2 / 16 and filtered.accuracy == 0.0  # right answers to block, and all blocked


def test_disabled_gives_no_processor(models, tiny_config):
    assert build_processors(tiny_config().deidentify, models.tokenizer, ["1+1=2"]) is None


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("key, value, message", [
    ("deidentify.ngram", 1, r"deidentify\.ngram=1 is invalid: must be an integer >= 2"),
    ("deidentify.false_positive_rate", 0.0, r"deidentify\.false_positive_rate=0\.0 is invalid: must be in \(0, 1\)"),
    ("deidentify.false_positive_rate", 1.0, r"deidentify\.false_positive_rate=1\.0 is invalid"),
    ("deidentify.corpus_file", "/no/such/corpus.txt", r"deidentify\.corpus_file='/no/such/corpus\.txt' is invalid"),
])
def test_bad_option_names_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config({key: value, "privacy.enabled": False})


def test_bad_options_of_the_python_api_name_the_key():
    with pytest.raises(ConfigError, match=r"deidentify\.ngram=1"):
        ProtectedNgrams.from_token_ids([[1, 2, 3]], ngram=1)
    with pytest.raises(ConfigError, match=r"deidentify\.false_positive_rate=1\.5"):
        ProtectedNgrams.from_token_ids([[1, 2, 3]], false_positive_rate=1.5)
    with pytest.raises(CorpusError, match=r"deidentify\.corpus_file='/no/such/file\.jsonl' cannot be read"):
        read_corpus("/no/such/file.jsonl")


def test_training_prompts_are_refused_as_protected_text_under_dp(tmp_path):
    with pytest.raises(ConfigError, match=r"deidentify\.protect_prompts=True is invalid: under privacy\.enabled"):
        parse_run_config({"deidentify.enabled": True})
    corpus = tmp_path / "mine.txt"
    corpus.write_text("patient id 4821-9930\n")
    config = parse_run_config({"deidentify.enabled": True, "deidentify.protect_prompts": False,
                               "deidentify.corpus_file": str(corpus)}).engine
    assert config.privacy.enabled and config.deidentify.enabled


def test_node_corpus_file_overrides_the_run_config(tmp_path, tiny_config):
    corpus = tmp_path / "org-a.jsonl"
    corpus.write_text('{"text": "patient id 4821-9930"}\n')
    config = with_node_corpus(tiny_config(), str(corpus))
    assert config.deidentify.corpus_file == str(corpus)
    assert read_corpus(corpus) == ["patient id 4821-9930"]
    with pytest.raises(ConfigError, match=r"deidentify\.corpus_file='/elsewhere' is invalid"):
        with_node_corpus(tiny_config(), "/elsewhere")


def test_memorised_secrets_are_never_reproduced_with_the_filter(models, tiny_config):
    """A deliberately memorising setup (the adapter fitted for 200 epochs on two secrets, no DP;
    greedy decoding wrote both from about 75 on, at Adam's lr 3e-3: at 1e-2 the loss diverged on
    this model): unfiltered, greedy and sampled decoding reproduce the secrets; filtered, never."""
    tokenizer, policy = models.tokenizer, models.policy
    secrets = {"1=": "4821-9930", "2=": "1357-2468"}
    texts = [tokenizer.bos_token + prompt + secret + tokenizer.eos_token for prompt, secret in secrets.items()]
    batch = tokenizer(texts, return_tensors="pt", add_special_tokens=False)
    saved = models.adapters.get_arrays()
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=3e-3)
    torch.manual_seed(0)
    try:
        policy.train()
        for _ in range(200):
            loss = policy(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        policy.eval()
        prompts = tokenizer([tokenizer.bos_token + p for p in secrets], return_tensors="pt",
                            add_special_tokens=False)
        processors = LogitsProcessorList([NoVerbatimNgrams(
            ProtectedNgrams.from_texts(tokenizer, list(secrets.values()), ngram=NGRAM))])

        def outputs(processors, sample):
            torch.manual_seed(1)
            ids = policy.generate(**prompts, max_new_tokens=10, do_sample=sample, num_return_sequences=16 if sample
                                  else 1, pad_token_id=tokenizer.pad_token_id, logits_processor=processors)
            return tokenizer.batch_decode(ids[:, prompts["input_ids"].shape[1]:], skip_special_tokens=True)

        def reproduced(texts):
            return sum(any(secret in text for secret in secrets.values()) for text in texts)

        assert reproduced(outputs(None, sample=False)) == 2  # every secret memorised
        assert reproduced(outputs(None, sample=True)) > 0
        assert reproduced(outputs(processors, sample=False)) == 0
        assert reproduced(outputs(processors, sample=True)) == 0
        fragments = {secret[i:i + NGRAM] for secret in secrets.values() for i in range(len(secret) - NGRAM + 1)}
        assert not any(f in text for f in fragments for text in outputs(processors, sample=True))
    finally:
        models.adapters.set_arrays(saved)


def test_serving_api_loads_the_runs_adapter_and_filters(tmp_path, models, val_rows, tiny_config):
    import dataclasses
    import json

    from flwr_verl.config import RunConfig
    from flwr_verl.tools.serving import deidentified_generation

    run = tmp_path / "run-1"
    models.adapters.save(run / "adapters" / "final")
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(RunConfig(engine=tiny_config()))))
    answers = [row["prompt"][0]["content"] + row["reward_model"]["ground_truth"] for row in val_rows]
    model, tokenizer, processors = deidentified_generation(run, answers, ngram=NGRAM)
    saved = dict(zip(models.adapters.names, models.adapters.get_arrays()))
    loaded = {f"policy/{name}": p.detach().numpy() for name, p in model.named_parameters() if "lora" in name}
    assert loaded and all((loaded[name] == saved[name]).all() for name in loaded)
    prompts = tokenizer([prompt_text(row, tokenizer) for row in val_rows[:16]], return_tensors="pt",
                        padding=True, add_special_tokens=False)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    plain = model.generate(**prompts, **kwargs)
    filtered = model.generate(**prompts, logits_processor=processors, **kwargs)
    protected = {g for ids in tokenizer(answers, add_special_tokens=False)["input_ids"] for g in _ngrams(ids, NGRAM)}
    width = prompts["input_ids"].shape[1]

    def emitted(ids):
        return {tuple(s[i - NGRAM + 1:i + 1]) for s in ids.tolist() for i in range(width, len(s))} & protected

    assert emitted(plain) and not emitted(filtered)
    with pytest.raises(FileNotFoundError, match="is not a PEFT adapter directory"):
        deidentified_generation(tmp_path / "nothing", answers)
