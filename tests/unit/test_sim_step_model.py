"""The step model reproduces DeepInfer's six published chart points within 10%."""

from __future__ import annotations

import pytest

from deepinfer_gateway.workers.sim.profiles import load_profile, load_profiles
from deepinfer_gateway.workers.sim.step_model import decode_seconds, interpolate_log, mixed_seconds, prefill_seconds

SM100 = load_profile("sm100")


@pytest.mark.parametrize(
    ("batch_per_gpu", "tok_s_per_gpu", "step_ms"),
    [(4096, 60_000, 68), (16384, 81_000, 200), (65536, 89_000, 730)],
)
def test_prefill_chart_points(batch_per_gpu: int, tok_s_per_gpu: float, step_ms: float) -> None:
    # One DP rank per GPU on the 4-GPU prefill instance: the rank batch is the GPU batch.
    seconds = prefill_seconds(SM100, batch_per_gpu)
    assert seconds * 1000 == pytest.approx(step_ms, rel=0.10)
    assert batch_per_gpu / seconds == pytest.approx(tok_s_per_gpu, rel=0.10)


@pytest.mark.parametrize(
    ("per_rank", "tok_s_per_user", "tok_s_per_gpu"),
    [(8, 325, 2_600), (64, 248, 15_500), (256, 103, 26_000)],
)
def test_decode_chart_points(per_rank: int, tok_s_per_user: float, tok_s_per_gpu: float) -> None:
    # A step emits `decode_tokens_per_step` tokens per user on average (speculative decoding).
    seconds = decode_seconds(SM100, per_rank) / SM100.decode_tokens_per_step
    assert 1 / seconds == pytest.approx(tok_s_per_user, rel=0.10)
    assert per_rank / seconds == pytest.approx(tok_s_per_gpu, rel=0.10)


def test_interpolation_is_monotone_and_clamped() -> None:
    curve = SM100.prefill_points
    assert interpolate_log(curve, 1) == curve[0][1]
    assert interpolate_log(curve, 10**7) == curve[-1][1]
    ys = [interpolate_log(curve, x) for x in range(4096, 65537, 512)]
    assert ys == sorted(ys)
    assert interpolate_log(curve, 8192) == pytest.approx((60_000 + 81_000) / 2)


def test_mixed_step_adds_prefill_and_decode() -> None:
    assert mixed_seconds(SM100, 4096, 64) == pytest.approx(prefill_seconds(SM100, 4096) + decode_seconds(SM100, 64))
    assert mixed_seconds(SM100, 0, 0) == 0


def test_ascend_profile_is_a_labelled_scaled_assumption() -> None:
    profiles = load_profiles()
    ascend = profiles["ascend950"]
    assert ascend.speed_factor == pytest.approx(0.6)
    assert ascend.kv_format != SM100.kv_format
    assert prefill_seconds(ascend, 4096) == pytest.approx(prefill_seconds(SM100, 4096) / 0.6)
    # ~40 GB of KV per GPU at 890 bytes/token.
    assert SM100.memory_capacity_blocks == int(40e9 * 4 // (890 * 128))


def test_user_profile_file(tmp_path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        '[tiny]\nhardware = "sm100"\nkv_format = "x"\nprefill_points = [[1, 1000]]\n'
        "decode_points = [[1, 10]]\ndp_ranks = 1\ngpus_per_instance = 1\nmemory_capacity_blocks = 8\n"
    )
    tiny = load_profile("tiny", path)
    assert tiny.memory_capacity_blocks == 8
    assert prefill_seconds(tiny, 500) == pytest.approx(0.5)
    with pytest.raises(KeyError):
        load_profile("nope", path)


@pytest.mark.parametrize("bad", ["nextn = -1", "acceptance = 1.5", "acceptance = -0.1"])
def test_speculative_fields_are_checked(tmp_path, bad: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(f'[bad]\nderived_from = "sm100"\n{bad}\n[sm100]\nhardware = "sm100"\nkv_format = "x"\n'
                    "prefill_points = [[1, 1000]]\ndecode_points = [[1, 10]]\n")
    with pytest.raises(ValueError, match="nextn must be >= 0 and acceptance within"):
        load_profile("bad", path)
