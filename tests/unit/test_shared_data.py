"""Where tests find the shared data (tests/shared_data.py): beside the clone, never at one
machine's path; missing, it skips a test, and under CI=true fails it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import shared_data

REPO = Path(__file__).resolve().parents[2]
# A quoted absolute path to a `shared` folder: what a test reading one machine's copy would write.
ABSOLUTE_SHARED = re.compile(r"""["']/[^"'\n]*\bshared/""")


def test_the_shared_data_is_found_beside_the_clone() -> None:
    assert shared_data.SHARED == REPO.parent / "shared"
    assert shared_data.CONVERSATION.is_relative_to(shared_data.SHARED)


def test_missing_shared_data_skips_outside_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="shared data missing"):
        shared_data.require(tmp_path / "absent")
    assert shared_data.require(tmp_path) == tmp_path


def test_missing_shared_data_fails_under_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="under CI=true missing shared data fails"):
        shared_data.require(tmp_path / "absent")


def test_no_test_or_benchmark_reads_shared_data_at_an_absolute_path() -> None:
    sources = [*REPO.joinpath("tests").rglob("*.py"), *REPO.joinpath("bench").rglob("*.py")]
    offenders = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
                 for path in sources if path != Path(__file__).resolve()
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if ABSOLUTE_SHARED.search(line)]
    assert not offenders, "use tests/shared_data.py (../shared beside the clone):\n" + "\n".join(offenders)
