"""Generation-time de-identification: never emit an n-gram of the protected text verbatim.

MemFree decoding (Ippolito et al. 2023, "Preventing Verbatim Memorization in Language Models
Gives a False Sense of Privacy"): every token n-gram of a protected corpus goes into a Bloom
filter; at each decoding step, every candidate token that would complete a protected n-gram
(the last n-1 tokens of the sequence, prompt included, followed by the candidate) gets logit
-inf, so greedy decoding takes the next-best token and sampling renormalises over the rest.

    protected = ProtectedNgrams.from_texts(tokenizer, my_private_texts, ngram=6, false_positive_rate=1e-4)
    model.generate(..., logits_processor=LogitsProcessorList([NoVerbatimNgrams(protected)]))

What it guarantees: no n-gram of the corpus (as the tokenizer splits it) is ever produced, except
an n-gram whose every next token is protected (the processor then leaves that one step alone,
rather than produce NaN), which needs ``vocabulary size`` protected n-grams sharing one prefix.
A Bloom filter has no false negatives, so nothing protected slips through; a false positive
(probability ``false_positive_rate`` per candidate) blocks an innocent token. What it does not
do: the same text tokenized differently, paraphrase, a change of case or spacing, or facts
spread over shorter n-grams all pass (Ippolito et al. show style-transfer prompts recover
memorised text around the filter). It prevents verbatim reproduction, not memorisation.

Where it runs: on the organisation's own node, from its own text (``deidentify.*`` config: its
training prompts, a corpus file, or both); the filter never leaves the node. ``LocalPPOTrainer``
applies it to that organisation's rollouts and evaluations; ``tools.serving.deidentified_generation`` is the
serving API for an adapter in a run directory. The filter is not covered by epsilon: it is a
deterministic function of the protected text. Under DP it is therefore built from the corpus
file only (``config.DeidentifyConfig``): a filter made of the training prompts would make every
prompt's rollouts depend on all the other prompts, coupling the privacy units.

Hashing: three polynomial hashes of the token ids modulo three primes below 2^31 (no int64
overflow, so the same on CPU and GPU), combined by double hashing (Kirsch & Mitzenmacher 2006)
into a filter's k bit positions. The (n-1)-token prefixes of the protected n-grams have a second,
coarser filter: a step whose context is no protected prefix costs a few tensor operations per
row; otherwise the whole vocabulary is checked at once, each hash function looking only at the
candidates the previous ones left. Size: about -log2(p)/ln 2 bits per protected n-gram for the
n-gram filter at false-positive rate p, plus 9.6 for the prefix filter (at 1%).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from flwr_verl.config import DeidentifyConfig, FlwrVerlError

_PRIMES = (2_147_483_647, 2_147_483_629, 2_147_483_587)
_BASES = (1_000_003, 998_244_353, 1_234_567_891)


class CorpusError(FlwrVerlError, ValueError):
    """The protected corpus file cannot be read."""


def _per_hash(values: tuple[int, int, int], like: torch.Tensor) -> torch.Tensor:
    """The three hash functions' constants, (3, 1, ...), to broadcast against (3, *like.shape)."""
    return torch.tensor(values, dtype=torch.int64, device=like.device).view(3, *([1] * like.dim()))


@functools.lru_cache(maxsize=64)
def _powers(length: int, device: torch.device) -> torch.Tensor:
    """base^(L-1-j) mod prime for each hash function and position j: (3, L)."""
    return torch.tensor([[pow(base, length - 1 - j, prime) for j in range(length)]
                         for prime, base in zip(_PRIMES, _BASES)], dtype=torch.int64, device=device)


def _hash_prefixes(prefixes: torch.Tensor) -> torch.Tensor:
    """Polynomial hashes of token-id sequences: (..., L) -> (3, ...), each below its prime:
    sum_j (t_j + 1) base^(L-1-j) mod prime, Horner's value in one pass over the positions. Every
    term is reduced below its prime (< 2^31) before the sum, so nothing overflows int64."""
    primes = _per_hash(_PRIMES, prefixes)
    powers = _powers(prefixes.shape[-1], prefixes.device).view(3, *([1] * (prefixes.dim() - 1)), -1)
    return ((prefixes + 1) * powers % primes).sum(-1) % primes[..., 0]


def _extend(h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The hashes of each sequence extended by one token: (3, ...) x (...) -> (3, ...), broadcast."""
    # +1: token 0 still changes the hash
    return (h * _per_hash(_BASES, h[0]) + tokens + 1) % _per_hash(_PRIMES, h[0])


def _extend_by_every_token(h: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``_extend`` of each of B hashes by every token id: (3, B) -> (3, B, vocab_size). The
    per-row part is reduced once; adding a token id below the prime needs a compare-subtract only."""
    tokens = torch.arange(vocab_size, device=h.device)
    out = []
    for i, (prime, base) in enumerate(zip(_PRIMES, _BASES)):
        row = ((h[i] * base + 1) % prime)[:, None] + tokens[None, :]
        out.append(torch.where(row >= prime, row - prime, row))
    return torch.stack(out)


@dataclass
class BloomFilter:
    """``bits`` and ``num_hashes`` hash functions over hashed token sequences, sized for
    ``capacity`` items at ``false_positive_rate``: bits = -N ln p / (ln 2)^2, hashes = bits/N ln 2."""

    bits: torch.Tensor  # (num_bits,) bool
    num_hashes: int

    @classmethod
    def sized(cls, capacity: int, false_positive_rate: float) -> BloomFilter:
        num_bits = max(8, math.ceil(-capacity * math.log(false_positive_rate) / math.log(2) ** 2))
        return cls(torch.zeros(num_bits, dtype=torch.bool), max(1, round(num_bits / max(capacity, 1) * math.log(2))))

    def _start(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Double hashing: hash function i of an item is (first + i * stride) mod num_bits."""
        num_bits = self.bits.numel()
        return (h[0] * _PRIMES[1] + h[1]) % num_bits, (h[2] | 1) % num_bits

    def _next(self, position: torch.Tensor, stride: torch.Tensor) -> torch.Tensor:
        position = position + stride  # both below num_bits: a compare-subtract, not a division
        return torch.where(position >= self.bits.numel(), position - self.bits.numel(), position)

    def add(self, h: torch.Tensor) -> None:
        """Insert hashed sequences, (3, N)."""
        position, stride = self._start(h)
        for _ in range(self.num_hashes):
            self.bits[position] = True
            position = self._next(position, stride)

    def members(self, h: torch.Tensor) -> torch.Tensor:
        """The indices of the hashed sequences (3, N) that may be in the filter (never a false
        negative). A few candidates (a decoding step's contexts) are looked up under every hash
        function at once; many (a context extended by every token) hash function by hash
        function, each looking only at the candidates the previous ones left."""
        position, stride = self._start(h)
        if h.shape[1] * self.num_hashes <= ONE_SHOT_LOOKUPS:
            steps = torch.arange(self.num_hashes, device=h.device)[:, None]
            return self.bits[(position + steps * stride) % self.bits.numel()].all(dim=0).nonzero().squeeze(1)
        alive = torch.arange(h.shape[1], device=h.device)
        for _ in range(self.num_hashes):
            keep = self.bits[position]
            alive, position, stride = alive[keep], position[keep], stride[keep]
            if alive.numel() == 0:
                break
            position = self._next(position, stride)
        return alive

    def contains(self, h: torch.Tensor) -> torch.Tensor:
        """(3, ...) hashes -> (...) bool."""
        found = torch.zeros(h[0].numel(), dtype=torch.bool, device=h.device)
        found[self.members(h.reshape(3, -1))] = True
        return found.reshape(h.shape[1:])

    def to(self, device: torch.device | str) -> BloomFilter:
        return BloomFilter(self.bits.to(device), self.num_hashes)


# The (n-1)-token prefixes get a second, coarser filter: a false positive there only costs time.
PREFIX_FALSE_POSITIVE_RATE = 0.01
# Up to this many bit lookups, BloomFilter.members does them all in one indexing operation.
ONE_SHOT_LOOKUPS = 1 << 16
BUILD_CHUNK = 1 << 20  # n-grams hashed at a time while a filter is built


@dataclass
class ProtectedNgrams:
    """The token n-grams of a protected corpus, in a Bloom filter (``ngrams``), and their
    (n-1)-token prefixes in a second one (``prefixes``): a decoding step whose context is no
    protected prefix, the usual case, is passed without checking the vocabulary."""

    ngram: int
    ngrams: BloomFilter
    prefixes: BloomFilter
    num_ngrams: int  # n-grams inserted (with repeats): the filters were sized for this many
    num_tokens: int  # tokens of the protected corpus

    @property
    def empty(self) -> bool:
        return self.num_ngrams == 0

    @property
    def nbytes(self) -> int:
        """The size of both filters as packed bit arrays."""
        return math.ceil(self.ngrams.bits.numel() / 8) + math.ceil(self.prefixes.bits.numel() / 8)

    @classmethod
    def from_token_ids(cls, sequences: Sequence[Sequence[int]], *, ngram: int = 6,
                       false_positive_rate: float = 1e-4) -> ProtectedNgrams:
        _check_options(ngram, false_positive_rate)
        sequences = [list(s) for s in sequences]
        num_ngrams = sum(max(len(s) - ngram + 1, 0) for s in sequences)
        ngrams = BloomFilter.sized(num_ngrams, false_positive_rate)
        prefixes = BloomFilter.sized(num_ngrams, PREFIX_FALSE_POSITIVE_RATE)
        windows = [torch.tensor(s, dtype=torch.int64).unfold(0, ngram, 1) for s in sequences if len(s) >= ngram]
        if windows:
            for chunk in torch.cat(windows).split(BUILD_CHUNK):  # (<= BUILD_CHUNK, n): bounded memory
                h = _hash_prefixes(chunk[:, :-1])
                prefixes.add(h)
                ngrams.add(_extend(h, chunk[:, -1]))
        return cls(ngram, ngrams, prefixes, num_ngrams=num_ngrams, num_tokens=sum(len(s) for s in sequences))

    @classmethod
    def from_texts(cls, tokenizer, texts: Iterable[str], *, ngram: int = 6,
                   false_positive_rate: float = 1e-4) -> ProtectedNgrams:
        """The n-grams of ``texts`` as ``tokenizer`` splits them (no special tokens)."""
        texts = [t for t in texts if t]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return cls.from_token_ids(ids, ngram=ngram, false_positive_rate=false_positive_rate)

    def to(self, device: torch.device | str) -> ProtectedNgrams:
        return dataclasses.replace(self, ngrams=self.ngrams.to(device), prefixes=self.prefixes.to(device))

    @property
    def device(self) -> torch.device:
        return self.ngrams.bits.device

    def contains(self, ngrams: torch.Tensor) -> torch.Tensor:
        """Whether each n-gram may be protected (no false negatives): (..., n) -> (...) bool."""
        if ngrams.shape[-1] != self.ngram:
            raise ValueError(f"expected n-grams of {self.ngram} tokens, got shape {tuple(ngrams.shape)}")
        return self.ngrams.contains(_hash_prefixes(ngrams.to(self.device)))

    def completions(self, prefixes: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """For each (n-1)-token prefix, which next tokens complete a protected n-gram:
        (B, n-1) -> (B, vocab_size) bool; None when no prefix is protected (the usual step)."""
        h = _hash_prefixes(prefixes)
        rows = self.prefixes.members(h)
        if rows.numel() == 0:
            return None
        blocked = torch.zeros(prefixes.shape[0], vocab_size, dtype=torch.bool, device=prefixes.device)
        found = self.ngrams.members(_extend_by_every_token(h[:, rows], vocab_size).reshape(3, -1))
        blocked[rows[found // vocab_size], found % vocab_size] = True
        return blocked


class NoVerbatimNgrams(LogitsProcessor):
    """A ``transformers`` logits processor: tokens that would complete a protected n-gram get
    -inf (MemFree decoding). ``generate`` runs it before temperature, top-k and top-p, so
    sampling draws from the allowed tokens only. A no-op with an empty corpus."""

    def __init__(self, protected: ProtectedNgrams) -> None:
        self.protected = protected

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        context = self.protected.ngram - 1
        if self.protected.empty or input_ids.shape[1] < context:
            return scores
        if self.protected.device != scores.device:
            self.protected = self.protected.to(scores.device)
        blocked = self.protected.completions(input_ids[:, -context:], scores.shape[1])
        if blocked is None:
            return scores
        blocked &= ~blocked.all(dim=1, keepdim=True)  # never leave a row with nothing to emit
        return scores.masked_fill(blocked, -math.inf)


# ----------------------------------------------------------------------------- where it applies
def _check_options(ngram: int, false_positive_rate: float) -> None:
    DeidentifyConfig(ngram=ngram, false_positive_rate=false_positive_rate)  # ConfigError naming the key


def read_corpus(path: str | Path) -> list[str]:
    """A protected corpus file: ``.jsonl`` (one JSON object per line, its ``"text"``) or plain
    text (one passage per non-empty line)."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise CorpusError(f"deidentify.corpus_file={str(path)!r} cannot be read: {error}") from error
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            texts.append(str(json.loads(line)["text"]))
        except (ValueError, KeyError, TypeError) as error:
            raise CorpusError(f"deidentify.corpus_file={str(path)!r} line {number}: expected a JSON object "
                              f"with a \"text\" field ({error})") from error
    return texts


def protected_texts(config: DeidentifyConfig, prompts: Iterable[str]) -> list[str]:
    """The text ``config`` protects: the organisation's training ``prompts`` when
    ``deidentify.protect_prompts``, and the passages of ``deidentify.corpus_file``."""
    texts = list(prompts) if config.protect_prompts else []
    if config.corpus_file:
        texts += read_corpus(config.corpus_file)
    return texts


def build_processors(config: DeidentifyConfig, tokenizer, prompts: Iterable[str]) -> LogitsProcessorList | None:
    """The logits processors for this organisation's generations; None when disabled."""
    if not config.enabled:
        return None
    protected = ProtectedNgrams.from_texts(tokenizer, protected_texts(config, prompts), ngram=config.ngram,
                                           false_positive_rate=config.false_positive_rate)
    return LogitsProcessorList([NoVerbatimNgrams(protected)])

