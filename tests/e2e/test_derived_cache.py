"""derived_cache: tokenizer-derived tables from disk equal freshly built ones; bad entries are rebuilt."""

from __future__ import annotations

import json
import marshal
import shutil
import subprocess
from pathlib import Path

import pytest

from deepinfer_gateway.recipe_bridge import derived_cache, detokenizer, segment_tokenizer, tokenizer
from deepinfer_gateway.recipe_bridge.segment_tokenizer import FastokensPlain, HfPlain, TiktokenPlain
from harness.launch import CLI, Gateway, SimCluster


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DGW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def entries(cache: Path, kind: str) -> list[Path]:
    return sorted(cache.glob(f"{kind}-*.marshal"))


def test_value_is_built_once_then_loaded(cache: Path) -> None:
    builds = []
    key = derived_cache.entry_key(derived_cache.digest(b"source"), tokenizer.__file__)

    def build() -> dict[int, bytes]:
        builds.append(1)
        return {1: b"a", 2: b"b"}

    assert derived_cache.cached("t", key, build, lambda v: isinstance(v, dict)) == {1: b"a", 2: b"b"}
    assert derived_cache.cached("t", key, build, lambda v: isinstance(v, dict)) == {1: b"a", 2: b"b"}
    assert len(builds) == 1 and len(entries(cache, "t")) == 1


def test_corrupt_or_invalid_entries_are_rebuilt(cache: Path) -> None:
    key = derived_cache.entry_key(derived_cache.digest(b"source"), tokenizer.__file__)
    cache.mkdir(parents=True)
    (cache / f"t-{key}.marshal").write_bytes(b"\xff not marshal")
    assert derived_cache.cached("t", key, lambda: "built", lambda v: isinstance(v, str)) == "built"
    derived_cache.store("t", key, 42)
    assert derived_cache.cached("t", key, lambda: "rebuilt", lambda v: isinstance(v, str)) == "rebuilt"


def test_unwritable_cache_dir_still_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DGW_CACHE_DIR", str(blocker / "cache"))  # a directory under a file
    assert derived_cache.cached("t", "k", lambda: "built", lambda v: isinstance(v, str)) == "built"


def test_keys_depend_on_source_code_and_versions() -> None:
    source = derived_cache.digest(b"source")
    keys = {
        derived_cache.entry_key(source, tokenizer.__file__),
        derived_cache.entry_key(derived_cache.digest(b"other"), tokenizer.__file__),
        derived_cache.entry_key(source, detokenizer.__file__),
        derived_cache.entry_key(source, tokenizer.__file__, "1.0"),
    }
    assert len(keys) == 4


def test_only_the_newest_entries_of_a_kind_are_kept(cache: Path) -> None:
    for i in range(derived_cache.KEEP_PER_KIND + 3):
        derived_cache.store("t", f"k{i}", i)
    derived_cache.store("u", "k", 0)
    assert len(entries(cache, "t")) == derived_cache.KEEP_PER_KIND
    assert len(entries(cache, "u")) == 1


def test_tokenizer_tables_from_cache_equal_fresh_ones(cache: Path) -> None:
    raw = tokenizer.default_tokenizer_json_path().read_text(encoding="utf-8")
    text = tokenizer._with_system_stand_in(raw)
    assert tokenizer._default_json_text() == text  # built and stored
    assert tokenizer._default_json_text() == text  # loaded
    assert entries(cache, "system-stand-in")

    fresh = tokenizer._read_facts(text)
    tokenizer._facts.cache_clear()
    assert tokenizer._facts(text) == fresh
    tokenizer._facts.cache_clear()
    assert tokenizer._facts(text) == fresh and entries(cache, "tokenizer-facts")

    assert detokenizer.TokenBytes(text).pieces == detokenizer._pieces(text)
    assert detokenizer.TokenBytes(text).pieces == detokenizer._pieces(text) and entries(cache, "token-bytes")


def test_plain_tokenizer_from_cached_ranks_is_the_checked_one(cache: Path) -> None:
    text = tokenizer.load_tokenizer().json_text
    segment_tokenizer.plain_tokenizer.cache_clear()
    built = segment_tokenizer.plain_tokenizer(text, prefer="tiktoken")
    assert isinstance(built, TiktokenPlain) and entries(cache, "tiktoken-ranks")
    segment_tokenizer.plain_tokenizer.cache_clear()
    loaded = segment_tokenizer.plain_tokenizer(text, prefer="tiktoken")
    assert isinstance(loaded, TiktokenPlain) and loaded is not built
    assert loaded.ranks == built.ranks
    sample = segment_tokenizer._SELF_CHECK + " plain text 12345 中文"
    assert loaded.encode(sample) == HfPlain(json.loads(text)).encode(sample)


def test_a_failed_self_check_is_not_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = tokenizer.load_tokenizer().json_text
    monkeypatch.setattr(TiktokenPlain, "encode", lambda self, text: [-1])
    monkeypatch.setattr(FastokensPlain, "encode", lambda self, text: [-1])
    segment_tokenizer.plain_tokenizer.cache_clear()
    try:
        choice = segment_tokenizer.choose_plain_tokenizer(text)
        assert isinstance(choice.tokenizer, HfPlain)
        assert "fastokens: its self-check differed" in choice.reason
        assert "tiktoken's self-check differed" in choice.reason
        assert not entries(cache, "tiktoken-ranks") and not entries(cache, "fastokens-check")
    finally:
        segment_tokenizer.plain_tokenizer.cache_clear()


def test_fastokens_check_is_cached_and_trusted_on_the_next_start(cache: Path) -> None:
    text = tokenizer.load_tokenizer().json_text
    first = segment_tokenizer.choose_plain_tokenizer(text)
    assert isinstance(first.tokenizer, FastokensPlain) and first.reason.endswith("self-check passed")
    assert entries(cache, "fastokens-check")
    again = segment_tokenizer.choose_plain_tokenizer(text)
    assert isinstance(again.tokenizer, FastokensPlain) and "start-up cache" in again.reason
    sample = segment_tokenizer._SELF_CHECK + " plain text 12345 中文"
    assert again.tokenizer.encode(sample) == HfPlain(json.loads(text)).encode(sample)


def test_tokenizer_json_without_added_tokens_is_cached(cache: Path) -> None:
    """fastokens is built from the tokenizer.json without its added vocabulary; a warm start reads
    that text from the cache instead of parsing and re-serializing the whole file."""
    text = tokenizer.load_tokenizer().json_text
    fresh = segment_tokenizer.without_added_tokens(text)
    assert json.loads(fresh) == {**json.loads(text), "added_tokens": []}
    (entry,) = entries(cache, "tokenizer-json-plain")
    entry.write_bytes(marshal.dumps("from the cache"))
    assert segment_tokenizer.without_added_tokens(text) == "from the cache"
    entry.write_bytes(b"not marshal")  # unreadable: rebuilt
    assert segment_tokenizer.without_added_tokens(text) == fresh


def test_warm_cache_command_writes_every_entry_a_gateway_and_worker_derive(cache: Path, tmp_path: Path) -> None:
    """`deepinfer-gateway warm-cache` (the Dockerfile's build step) writes exactly the entries
    a cold gateway and sim worker write into an empty cache (keys are deterministic, so a
    process started after warm-cache finds every one of them)."""
    cluster = SimCluster("unified:sm100")
    try:
        gateway = Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")])
        try:
            gateway.wait_ready(1)
        finally:
            gateway.stop()
    finally:
        cluster.stop()
    derived = sorted(p.name for p in cache.glob("*.marshal"))
    assert {name.split("-")[0] for name in derived} == {"system", "fastokens", "token", "tokenizer"}
    shutil.rmtree(cache)
    subprocess.run(CLI + ["warm-cache"], check=True, timeout=60)
    assert sorted(p.name for p in cache.glob("*.marshal")) == derived
