"""bench/bf16_gemm.py's arithmetic without a GPU: the products' shapes at a token count and a tile's time a
wave (what told the head's logits apart from fc's product on the same tile)."""
import pytest

from bench import bf16_gemm


def test_time_a_wave_of_tiles():
    # the logits at B8 on 256 x 128: 32 x 393 = 12576 tiles, 96 waves of 132
    assert bf16_gemm.wave_us(0.96, 8192, 50304, (256, 128, 4, 0), 132) == pytest.approx(10.0)
    # fc: 32 x 24 = 768 tiles, 6 waves; a partial last wave counts whole
    assert bf16_gemm.wave_us(0.06, 8192, 3072, (256, 128, 4, 0), 132) == pytest.approx(10.0)
    assert bf16_gemm.wave_us(0.01, 100, 100, (128, 128, 6, 1), 132) == pytest.approx(10.0)


def test_shapes_follow_the_token_count():
    rows = {r[0]: r for r in bf16_gemm.gpt2_shapes(16384)}
    assert rows["fwd head"][1:4] == (16384, 50304, 768)
    assert rows["dW fc"][1:4] == (3072, 768, 16384)
    assert rows["dX fc proj rc"][1:6] == (16384, 3072, 768, "NN", "dgelu_gelu")


def test_bad_token_count_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bf16_gemm.main(["--speed", "--tokens", "0"])
    assert e.value.code == 2 and "--tokens 0: a positive count" in capsys.readouterr().err
