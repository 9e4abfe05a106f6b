"""The vLLM venv's /dev/shm check: too small or missing shared memory is reported with the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.vllm_venv import SharedMemoryTooSmall, VllmInstallError, check_shared_memory


def test_smaller_than_the_minimum_is_refused_with_the_fix(tmp_path: Path) -> None:
    stats = os.statvfs(tmp_path)
    size = stats.f_frsize * stats.f_blocks
    check_shared_memory(str(tmp_path), minimum=size)  # exactly enough
    with pytest.raises(SharedMemoryTooSmall, match="--shm-size") as raised:
        check_shared_memory(str(tmp_path), minimum=size + 1)
    assert isinstance(raised.value, VllmInstallError)  # the fixture reports it as it reports install errors


def test_missing_shared_memory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SharedMemoryTooSmall, match="missing"):
        check_shared_memory(str(tmp_path / "no-shm"))
