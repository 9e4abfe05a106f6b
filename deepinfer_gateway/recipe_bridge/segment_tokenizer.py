"""Plain-text tokenizers: the text between two special tokens -> token ids, no added vocabulary.

deepseek-recipe's prompt encoding (`DeepseekV41Encoding.encode`) tokenizes the text
between the rendered special-token ranges as plain text: the tokenizer.json's
pre-tokenizer + byte-level BPE, with NO matching of the added vocabulary (a user who
types `<｜User｜>` or `<think>` gets the plain-text pieces, not the special id). Checked:
per-segment encoding with either tokenizer below reproduces `encode` token for token
(tests/unit/test_encoder.py, a hypothesis property test over whole conversations).

Three implementations, all exact, tried in this order (`plain_tokenizer` logs its choice
and the reason once per process and tokenizer.json):

- `FastokensPlain` (preferred, ~15x faster than tiktoken: 23 vs 374 ns/token on the
  128k-token bench text, one core; a cold 128k-token first turn prepares in ~12 ms):
  `fastokens` (Rust), whose hand-written scanner implements exactly DeepSeek's
  three-split pre-tokenizer, `encode_ordinary` = no added-vocabulary matching. Used only
  when the tokenizer.json has the recognised settings (`_recognised`, the same gate as
  tiktoken's) AND a self-check on `_SELF_CHECK` matches the reference; a passed check is
  kept in `derived_cache`. Text with lone surrogates fails with `UnicodeEncodeError`, as
  the reference does (tiktoken instead encodes them as U+FFFD). Built from the
  tokenizer.json without its added vocabulary (its batch call, `encode_packed`, has no
  ordinary mode; that text is kept in `derived_cache`, `without_added_tokens`). Building
  it costs ~1.1-1.7 s CPU (fastokens parsing the tokenizer.json itself) and ~90 MiB per
  process, where tiktoken's cached ranks load in ~0.15 s.
- `TiktokenPlain` (first fallback, ~6.5x faster than HfPlain: 2.9 vs 0.45 Mtok/s on 2 MB of Python source,
  one core; a cold 128.7k-token conversation encodes in ~42 ms vs deepseek-recipe's
  `encode` at ~145 ms wall / ~180 ms CPU). A `tiktoken.Encoding` built from the tokenizer.json itself (tiktoken's own
  encodings are downloaded at run time; none is used): ranks = the BPE vocabulary with
  the byte-level alphabet mapped back to bytes (GPT-2 byte decoder), which equals
  Hugging Face's merge-list BPE here because the merge list is ordered exactly by the
  id of each merge's result and no two merges yield the same string (verified at
  construction). The pre-tokenizer is a Sequence of three `Split(Isolated)` regexes
  (digits `\\p{N}{1,3}`, then CJK runs, then the GPT-style word regex R3) that tiktoken's
  single leftmost-first regex cannot take literally; `_DEEPSEEK_PAT` composes them:
  `N{1,3} | CJK+ | R3' | gap`, where R3' is R3 with every character class intersected
  with "not a digit, not CJK" (so no piece crosses the earlier splits' boundaries) and
  its `(?!\\S)` lookahead widened to treat a following digit/CJK char as end of text
  (R3 saw the gap between earlier splits as a whole string), and `gap` reproduces
  `Split(Isolated)`'s unmatched stretches (e.g. a ZWJ inside an emoji sequence), which
  tiktoken would otherwise drop. Used only when the tokenizer.json has exactly the
  recognised pre-tokenizer/normalizer/model settings AND a construction-time
  self-check on `_SELF_CHECK` matches the reference; otherwise the fallback is used.
  Ranks that passed are kept in `derived_cache` (keyed by the tokenizer.json, this
  module's source and the tiktoken/deepseek-recipe versions), so later starts skip the check.
- `HfPlain` (fallback, any tokenizer.json): deepseek-recipe's `Tokenizer` loaded from
  the same tokenizer.json with `added_tokens` removed.

Residual risk: the regex engines (Oniguruma in Hugging Face tokenizers, Rust
`regex` in tiktoken) may carry different Unicode versions, so a code point assigned in
the newer version could be classified differently; none was found in 300k random
strings over the whole code space plus 12.6M tokens of source code.
"""

from __future__ import annotations

import json
import logging
import sys
from array import array
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Literal, NamedTuple, Protocol

import deepseek_recipe as dr
import tiktoken

try:
    import fastokens
except ImportError:  # an optional speed-up: tiktoken and HfPlain are exact without it
    fastokens = None

from deepinfer_gateway.kvcache.hashing import pack_tokens
from deepinfer_gateway.recipe_bridge import derived_cache
from deepinfer_gateway.recipe_bridge.detokenizer import byte_alphabet

log = logging.getLogger(__name__)


class PlainTokenizer(Protocol):
    name: str
    # Its pre-tokenizer is DeepSeek's: text cut before a space between two ASCII letters
    # tokenizes exactly as the whole (encoder.py caches long segments in such pieces).
    cuts_at_word_spaces: bool

    def encode(self, text: str) -> list[int]: ...

    def encode_packed(self, texts: list[str]) -> list[bytes]:
        """Each text's ids as little-endian uint32 words (kvcache.hashing.pack_tokens)."""
        ...


def _packed_each(encode: Callable[[str], list[int]], texts: list[str]) -> list[bytes]:
    return [pack_tokens(encode(text)) for text in texts]


class HfPlain:
    name = "deepseek-recipe Tokenizer, added vocabulary removed"

    def __init__(self, tokenizer_json: dict[str, Any]):
        self.cuts_at_word_spaces = _recognised(tokenizer_json)
        stripped = {**tokenizer_json, "added_tokens": []}
        self._tokenizer = dr.Tokenizer.from_str(json.dumps(stripped, ensure_ascii=False))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def encode_packed(self, texts: list[str]) -> list[bytes]:
        return _packed_each(self.encode, texts)


# The DeepSeek V3/V4 pre-tokenizer, as tokenizer.json spells it (checked for equality).
_CJK = "一-龥぀-ゟ゠-ヿ"
_R3 = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
_DEEPSEEK_SPLITS = ("\\p{N}{1,3}", f"[{_CJK}]+", _R3)

_E = f"\\p{{N}}{_CJK}"  # characters the first two splits isolate
_R3_PRIME = "|".join([
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+",
    f"[^\r\n\\p{{L}}\\p{{P}}\\p{{S}}{_E}]?[[\\p{{L}}\\p{{M}}]&&[^{_E}]]+",
    f" ?[[\\p{{P}}\\p{{S}}]&&[^{_E}]]+[\r\n]*",
    "\\s*[\r\n]+",
    f"\\s+(?![^\\s{_E}])",
    "\\s+",
])
_DEEPSEEK_PAT = f"\\p{{N}}{{1,3}}|[{_CJK}]+|{_R3_PRIME}|(?:(?!{_R3_PRIME})[^{_E}])+"

_SELF_CHECK = (
    "Hello, world!  It's 2025-01-31T12:34:56Z; x=12345678 y=-0.5e10.\n\n\tdef f(a):\r\n"
    "    return a**2  # comment   \n中文文本，日本語のテキスト・カタカナー、한국어 텍스트 ١٢٣ １２３ "
    "café e\u0301 \u0301x 👨\u200d👩\u200d👧 🎉\ufe0f \x00\x01 \u200b\u3000\u00a0 <｜User｜><think>"
    "</think> {\"k\": [1, 2]} ... ?! ``` ** __init__ $PATH ẞ ǅ Ⅻ ½ ²"
)

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def _recognised(data: dict[str, Any]) -> bool:
    """True when tokenizer.json is DeepSeek's byte-level BPE that `_DEEPSEEK_PAT` models."""
    normalizer = data.get("normalizer")
    if normalizer not in (None, {"type": "Sequence", "normalizers": []}):
        return False
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [])
    splits = tuple(
        s.get("pattern", {}).get("Regex") for s in steps[:-1]
        if s.get("type") == "Split" and s.get("behavior") == "Isolated" and not s.get("invert")
    )
    if pre.get("type") != "Sequence" or splits != _DEEPSEEK_SPLITS or steps[-1:] != [_BYTE_LEVEL]:
        return False
    model = data.get("model", {})
    return (
        model.get("type") == "BPE" and not model.get("dropout") and not model.get("byte_fallback")
        and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix")
    )


def _ranks(data: dict[str, Any]) -> dict[bytes, int] | None:
    """BPE ranks = ids, or None when the merge order is not the id order (tiktoken would differ)."""
    vocab: dict[str, int] = data["model"]["vocab"]
    previous = -1
    results: set[int] = set()
    for merge in data["model"]["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        result = vocab.get(left + right)
        if result is None or result <= previous or result in results:
            return None
        previous = result
        results.add(result)
    decoder = byte_alphabet()
    added = {t["content"] for t in data.get("added_tokens", [])}
    ranks: dict[bytes, int] = {}
    for piece, token_id in vocab.items():
        if piece in added:  # e.g. <｜begin▁of▁sentence｜>: unreachable by merges, never plain text
            continue
        if len(piece) > 1 and token_id not in results:
            return None  # a multi-byte token no merge produces: tiktoken could emit it, BPE not
        try:
            ranks[bytes(decoder[ch] for ch in piece)] = token_id
        except KeyError:
            return None
    return ranks if len({k for k in ranks if len(k) == 1}) == 256 else None


class TiktokenPlain:
    name = "tiktoken, DeepSeek BPE ranks from tokenizer.json"
    cuts_at_word_spaces = True  # built only for DeepSeek's pre-tokenizer

    def __init__(self, ranks: dict[bytes, int]):
        self.ranks = ranks  # tiktoken.Encoding keeps it too: no extra memory
        self._encoding = tiktoken.Encoding(
            "deepseek-plain-text", pat_str=_DEEPSEEK_PAT, mergeable_ranks=ranks, special_tokens={}
        )

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_packed(self, texts: list[str]) -> list[bytes]:
        return _packed_each(self.encode, texts)


class FastokensPlain:
    cuts_at_word_spaces = True  # built only for DeepSeek's pre-tokenizer

    def __init__(self, tokenizer_json: str):
        if fastokens is None:
            raise RuntimeError("fastokens is not installed")
        self.name = f"fastokens {_fastokens_version()}, DeepSeek pre-tokenizer scanner"
        # Built without the added vocabulary: its batch call (`encode_packed`) has no
        # ordinary mode and would match e.g. `<｜User｜>` typed in a message.
        self._tokenizer = fastokens.Tokenizer.from_json_str(without_added_tokens(tokenizer_json))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode_ordinary(text).ids
        return ids

    def encode_packed(self, texts: list[str]) -> list[bytes]:
        """One call for all texts, straight to packed words: no Python int per token (~2x
        cheaper than `encode` per text + `pack_tokens` on a 128k-token prompt's segments)."""
        if not texts:
            return []
        flat, offsets = self._tokenizer.encode_batch_flat(texts)
        ends = array("Q", offsets)
        if sys.byteorder == "big":
            ends.byteswap()
            words = array("I", flat)
            words.byteswap()
            flat = words.tobytes()
        return [flat[4 * ends[i]:4 * ends[i + 1]] for i in range(len(texts))]


_STRIPPED_KIND = "tokenizer-json-plain"


def without_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer.json with an empty added vocabulary, kept in `derived_cache`: a warm
    start skips parsing and re-serializing the 6 MB text in Python (~0.2 s CPU, and the
    parsed vocabulary's ~80 MiB of objects at the start-up peak)."""
    key = derived_cache.entry_key(derived_cache.text_digest(tokenizer_json), __file__)
    return derived_cache.cached(_STRIPPED_KIND, key, lambda: json.dumps(
        {**json.loads(tokenizer_json), "added_tokens": []}, ensure_ascii=False), lambda value: isinstance(value, str))


def _fastokens_version() -> str:
    return str(getattr(fastokens, "__version__", "")) or _distribution_version("fastokens")


def _distribution_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


Preference = Literal["fastokens", "tiktoken", "hf"]


class Choice(NamedTuple):
    tokenizer: PlainTokenizer
    reason: str


@lru_cache(maxsize=4)
def plain_tokenizer(tokenizer_json: str, *, prefer: Preference = "fastokens") -> PlainTokenizer:
    """The fastest exact plain-text tokenizer for this tokenizer.json (built once per text;
    stateless, so encoders share it), its choice logged with the reason. `prefer` skips the
    faster kinds (benchmarks and tests compare them)."""
    choice = choose_plain_tokenizer(tokenizer_json, prefer)
    log.info("plain-text tokenizer: %s (%s)", choice.tokenizer.name, choice.reason)
    return choice.tokenizer


def choose_plain_tokenizer(tokenizer_json: str, prefer: Preference = "fastokens") -> Choice:
    if prefer == "hf":
        return Choice(HfPlain(json.loads(tokenizer_json)), "asked for the reference tokenizer")
    declined: list[str] = []
    if prefer == "fastokens":
        fast, why = _fastokens_plain(tokenizer_json)
        if fast is not None:
            return Choice(fast, why)
        declined.append(f"not fastokens: {why}")
    else:
        declined.append("fastokens not asked for")
    tokenizer, why = _tiktoken_plain(tokenizer_json)
    return Choice(tokenizer, "; ".join([*declined, why]))


_FASTOKENS_KIND = "fastokens-check"


def _fastokens_plain(tokenizer_json: str) -> tuple[FastokensPlain | None, str]:
    if fastokens is None:
        return None, "the fastokens package is not installed"
    key = derived_cache.entry_key(derived_cache.text_digest(tokenizer_json), __file__, _fastokens_version(),
                                  dr.__version__)
    checked = derived_cache.load(_FASTOKENS_KIND, key) is True
    if not checked and not _recognised(json.loads(tokenizer_json)):
        return None, "the tokenizer.json's pre-tokenizer is not DeepSeek's"
    try:
        fast = FastokensPlain(tokenizer_json)
    except Exception as error:  # a fastokens that cannot load this tokenizer.json: fall back, say why
        return None, f"fastokens could not load the tokenizer.json ({error})"
    if checked:
        return fast, "DeepSeek pre-tokenizer; self-check passed earlier (start-up cache)"
    reference = HfPlain(json.loads(tokenizer_json))
    sample = _self_check_sample()
    expected = reference.encode(sample)
    if fast.encode(sample) != expected or fast.encode_packed([sample]) != [pack_tokens(expected)]:
        return None, "its self-check differed from the reference tokenizer"
    derived_cache.store(_FASTOKENS_KIND, key, True)  # only a passed self-check is cached
    return fast, "DeepSeek pre-tokenizer; self-check passed"


def _self_check_sample() -> str:
    return _SELF_CHECK * 2 + " " + _SELF_CHECK[::-1]


def _tiktoken_plain(tokenizer_json: str) -> tuple[PlainTokenizer, str]:
    key = derived_cache.entry_key(derived_cache.text_digest(tokenizer_json), __file__, tiktoken.__version__,
                                  dr.__version__)
    ranks = derived_cache.load(_RANKS_KIND, key)
    if isinstance(ranks, dict):
        return TiktokenPlain(ranks), "tiktoken: ranks checked earlier (start-up cache)"
    tokenizer, why = _checked_plain_tokenizer(json.loads(tokenizer_json))
    if isinstance(tokenizer, TiktokenPlain):  # only a passed self-check is cached
        derived_cache.store(_RANKS_KIND, key, tokenizer.ranks)
    return tokenizer, why


_RANKS_KIND = "tiktoken-ranks"


def _checked_plain_tokenizer(data: dict[str, Any]) -> tuple[PlainTokenizer, str]:
    """TiktokenPlain when it models this tokenizer.json and passes the self-check, else HfPlain."""
    fallback = HfPlain(data)
    if not _recognised(data):
        return fallback, "the pre-tokenizer is not DeepSeek's: the reference tokenizer"
    ranks = _ranks(data)
    if ranks is None:
        return fallback, "BPE merges not in id order (tiktoken would differ): the reference tokenizer"
    try:
        fast = TiktokenPlain(ranks)
    except ValueError:  # a tiktoken whose regex engine rejects the class syntax
        return fallback, "tiktoken's regex engine rejected the pattern: the reference tokenizer"
    sample = _self_check_sample()
    if fast.encode(sample) != fallback.encode(sample):
        return fallback, "tiktoken's self-check differed: the reference tokenizer"
    return fast, "tiktoken: DeepSeek pre-tokenizer, ranks and self-check passed"
