"""bench/grad_pairs.py without a GPU: the recording runtime runs its launches (each pair's bits compared with
the apart products', the timing replaced by one call), and bad arguments are one line."""
import pytest

from bench import grad_pairs
from tests.conftest import FakeGemmRT


class _Clock:
    def stop(self):
        return "clock n/a"


def test_every_pair_and_tile_on_the_recording_runtime(monkeypatch, capsys):
    monkeypatch.setattr(grad_pairs, "Runtime", lambda *a, **k: FakeGemmRT("bf16", arch="sm_90"))
    monkeypatch.setattr(grad_pairs, "time_graphed_ms", lambda rt, fn, iters=0, reps=0: (fn(), 1.0)[1])
    monkeypatch.setattr(grad_pairs, "ClockWatch", _Clock)
    assert grad_pairs.main(["--tokens", "2048", "--all", "--iters", "1"]) == 0     # (head: the same path, 38M weights)
    out = capsys.readouterr().out
    layers = [name for name in grad_pairs.PAIRS if name != "head"]
    for name in layers:
        assert f"{name:<7} T2048: apart 1.0000 ms, paired 1.0000 ms" in out
    assert out.count("bitwise yes") == len(layers) and "128x256s4/4" in out and "256x128s4/4" in out


@pytest.mark.parametrize("argv,msg", [(["--tokens", "0"], "positive counts"), (["--pairs", "fc,lm"], "unknown lm")])
def test_bad_arguments_are_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        grad_pairs.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
