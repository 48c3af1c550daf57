"""plot.py on a recorded metrics.jsonl (a reference-backend run of configs/tiny.yaml with HellaSwag): the
panels hold the records' numbers, several runs are overlaid by name, each format is a real picture, and
the errors (matplotlib missing among them) are one line with exit code 2."""
import importlib
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "tests" / "fixtures" / "metrics_tiny.jsonl"
plot = importlib.import_module("plot")


@pytest.fixture
def runs(tmp_path):
    for name in ("tf32", "bf16"):
        (tmp_path / name).mkdir()
        shutil.copy(RECORDED, tmp_path / name / "metrics.jsonl")
    return tmp_path / "tf32", tmp_path / "bf16"


def test_the_panels_hold_the_records(runs):
    pytest.importorskip("matplotlib")
    data = [plot.read_run(str(r)) for r in runs]
    recs = data[0][1]
    fig = plot.figure(data)
    ax = {a.get_title(): a for a in fig.axes}
    lines = {l.get_label(): l for l in ax["loss against steps"].lines}
    assert set(lines) >= {"tf32 train", "tf32 val", "bf16 train", "bf16 val"}
    assert list(lines["tf32 val"].get_xdata()) == [r["step"] for r in recs if "eval_val" in r]
    assert list(lines["tf32 val"].get_ydata()) == [r["eval_val"] for r in recs if "eval_val" in r]
    per = next(r["tok_s"] * r["ms"] / 1e3 for r in recs if "tok_s" in r)
    assert per == pytest.approx(4 * 64)                     # batch_size x block_size of the recorded run
    tok = {l.get_label(): l for l in ax["loss against tokens"].lines}["bf16 train"]
    assert list(tok.get_xdata()) == pytest.approx([r["step"] * per for r in recs if "loss" in r])
    assert [l.get_label() for l in ax["HellaSwag acc_norm"].lines] == ["tf32", "bf16"]
    assert list(ax["learning rate"].lines[0].get_ydata()) == [r["lr"] for r in recs if "lr" in r]


@pytest.mark.parametrize("ext", [".png", ".svg", ".html"])
def test_writes_the_picture(runs, tmp_path, capsys, ext):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"p{ext}"
    assert plot.main([str(runs[0]), str(runs[1] / "metrics.jsonl"), "--out", str(out), "--logx"]) == 0
    assert capsys.readouterr().out == f"wrote {out}: tf32, bf16\n"
    body = out.read_bytes()
    if ext == ".png":
        import matplotlib.image
        assert body[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(str(out))
        assert img.shape[0] > 500 and img.shape[1] > 1000 and img.std() > 0.05     # not a blank page
    else:
        svg = body.decode()[body.decode().index("<svg"):body.decode().index("</svg>") + 6]
        ET.fromstring(svg)                                                        # well-formed
        assert "tf32 vs bf16" in svg or "tf32" in svg
    # an existing picture is kept unless --overwrite
    assert plot.main([str(runs[0]), "--out", str(out)]) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err and out.read_bytes() == body


def test_errors_are_one_line(runs, tmp_path, capsys, monkeypatch):
    cases = [([str(tmp_path / "none")], "no metrics.jsonl"), ([], "name at least one run"),
             ([str(runs[0]), "--out", str(tmp_path / "x.jpg")], "the picture is .png"),
             ([str(runs[0]), "--bins=3"], "unknown option --bins=3")]
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3}\n')
    cases.append(([str(torn)], "torn/metrics.jsonl:2: not a JSON record"))
    for argv, msg in cases:
        assert plot.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and msg in err, err
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # matplotlib not installed
    assert plot.main([str(runs[0]), "--out", str(tmp_path / "m.png")]) == 2
    assert capsys.readouterr().err == 'error: plot.py needs matplotlib: pip install -e ".[plot]"\n'
    assert not (tmp_path / "m.png").exists()
