"""bench/energy.py and bench/common.energy_per_run: the batch sizing, the per-run means, the labels' groups
and the report (no GPU: the energy counter, the clock and the launches are made here)."""
from types import SimpleNamespace

import pytest

from bench import common, energy
from gptcuda.runtime import profile


class Board:
    """A fake GPU: runs take `ms` of a clock that the board's counter turns into joules at `watts`."""

    def __init__(self, ms, watts, counter=True):
        self.t, self.mj, self.ms, self.watts, self.counter = 0.0, 5_000_000, ms, watts, counter
        self.runs = self.pending = 0

    def run(self):
        self.pending += 1

    def sync(self):                    # the queued runs finish: time passes, energy is spent
        dt = self.pending * self.ms / 1e3
        self.t += dt
        self.mj += self.watts * dt * 1e3
        self.runs += self.pending
        self.pending = 0

    def clock(self):
        return self.t

    def read(self):
        return int(self.mj) if self.counter else None


def test_energy_per_run_sizes_the_batch_and_takes_means():
    b = Board(ms=4.0, watts=650.0)
    d = common.energy_per_run(b.run, b.sync, 1.0, read=b.read, clock=b.clock)
    assert d["runs"] == 250 and b.runs == 252                  # 1 s of 4 ms runs, after two sizing runs
    assert d["ms"] == pytest.approx(4.0)
    assert d["mj"] == pytest.approx(2600.0, abs=0.01)          # 650 W x 4 ms
    assert d["watts"] == pytest.approx(650.0, rel=1e-4)
    slow = Board(ms=900.0, watts=300.0)
    assert common.energy_per_run(slow.run, slow.sync, 1.0, read=slow.read, clock=slow.clock)["runs"] == 3
    none = Board(ms=2.0, watts=500.0, counter=False)
    d = common.energy_per_run(none.run, none.sync, 0.1, read=none.read, clock=none.clock)
    assert d["mj"] is None and d["watts"] is None and d["ms"] == pytest.approx(2.0)


def test_energy_mj_without_nvml_is_none(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_nvml(name, *a, **k):
        if name == "pynvml":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_nvml)
    assert common.energy_mj() is None


def rec(file, name, label=None):
    return SimpleNamespace(fn=SimpleNamespace(file=file, name=name), label=label)


def test_label_groups_keep_program_order_and_leave_out_ordering_records():
    a1, a2 = rec("gemm_wgmma.cu", "gemm<1>", "matmul[16384x768x3072]"), rec("gemm_wgmma.cu", "gemm<2>",
                                                                              "matmul[16384x768x3072]")
    ln, ev, nccl = rec("layernorm.cu", "layernorm_fwd<6>"), rec("stream", "wait"), rec("nccl", "allreduce")
    memset = SimpleNamespace(label=None)
    groups = energy.label_groups([a1, ln, ev, a2, nccl, memset])
    assert groups == {"matmul[16384x768x3072]": [a1, a2], "layernorm_fwd<6>": [ln], "memset": [memset]}
    assert profile.launch_label(memset) == "memset" and profile.launch_label(a1) == "matmul[16384x768x3072]"


def test_repeats_fill_a_replay_within_bounds_and_per_call_divides():
    assert common.repeats_for(0.1) == 50                       # 5 ms of a 0.1 ms label
    assert common.repeats_for(12.0) == 1
    assert common.repeats_for(0.0) == 4096
    d = common.per_call({"runs": 7, "ms": 5.0, "mj": 3000.0, "watts": 600.0}, 50)
    assert d == {"runs": 7, "ms": 0.1, "mj": 60.0, "watts": 600.0}
    assert common.per_call({"runs": 7, "ms": 5.0, "mj": None, "watts": None}, 5)["mj"] is None
    assert common.energy_cell(d) == " [60.00 mJ 600 W]"
    assert common.energy_cell({"mj": None, "watts": None}) == " [no energy counter]"


def test_energy_table_orders_by_joules_and_shares():
    step = {"runs": 70, "ms": 28.9, "mj": 20_000.0, "watts": 692.0}
    rows = [("loss", {"crossentropy<1>"}, {"runs": 9, "ms": 0.85, "mj": 400.0, "watts": 470.0}),
            ("matmul[a]", {"gemm<2>", "gemm<1>"}, {"runs": 9, "ms": 1.7, "mj": 1200.0, "watts": 706.0}),
            ("adamw", {"adamw"}, {"runs": 9, "ms": 0.9, "mj": 400.0, "watts": 444.0})]
    out = energy.energy_table(step, 75.0, rows).splitlines()
    assert out[0] == "idle board: 75 W"
    assert out[1].startswith("step:   28.900 ms   20.000 J   692 W")
    assert "3.450 ms    2.000 J a step" in out[2]
    assert out[4].endswith("matmul[a] | gemm<1> gemm<2>") and " 60.0 " in out[4]
    assert [line.split()[-3] for line in out[5:]] == ["loss", "adamw"]       # equal joules: the input order
    bare = energy.energy_table({"runs": 3, "ms": 1.0, "mj": None, "watts": None}, None,
                               [("a", {"k"}, {"runs": 3, "ms": 0.2, "mj": None, "watts": None}),
                                ("b", {"k"}, {"runs": 3, "ms": 0.5, "mj": None, "watts": None})]).splitlines()
    assert bare[0] == "idle board: no energy counter" and [line.split()[-3] for line in bare[4:]] == ["b", "a"]


def test_help_prints_the_usage(capsys):
    energy.main(["--help"])
    assert "Where a training step's energy goes" in capsys.readouterr().out


def test_energy_graphed_repeats_a_call_in_one_graph_and_gives_one_calls_share():
    b = Board(ms=5.0, watts=700.0)                             # one replay: 10 calls of 0.5 ms
    log = []

    class Dev:
        def begin_capture(self, stream):
            log.append("begin")

        def end_capture(self, stream):
            log.append("end")
            return "graph", "exe"

        def graph_launch(self, exe, stream):
            b.run()

        def graph_destroy(self, graph, exe):
            log.append("destroy")

    rt = SimpleNamespace(dev=Dev(), stream=None, synchronize=b.sync)
    d = common.energy_graphed(rt, lambda: log.append("call"), 0.5, 0.5, read=b.read, clock=b.clock)
    assert log == ["begin"] + ["call"] * 10 + ["end", "destroy"]
    assert d["ms"] == pytest.approx(0.5) and d["mj"] == pytest.approx(350.0, rel=1e-4) and d["runs"] == 100


def test_main_measures_the_step_and_each_label(monkeypatch, capsys):
    """main's glue with the engine, the timing and the counter made here: the step's numbers, one row a label
    (its launches summed, the stream's records left out), the labels' times passed on to energy_graphed."""
    recs = [rec("gemm_wgmma.cu", "gemm<1>", "matmul[a]"), rec("stream", "wait"), rec("layernorm.cu", "ln<6>"),
            rec("gemm_wgmma.cu", "gemm<2>", "matmul[a]")]
    prog = type("Prog", (), {"items": recs, "__len__": lambda self: len(recs)})()
    rt = SimpleNamespace(synchronize=lambda: None, dev=None, stream=None)
    eng = SimpleNamespace(be=SimpleNamespace(rt=rt, capture=lambda p: "graph"), programs={"train": prog}, graphs={},
                          train_step=lambda: None)
    monkeypatch.setattr(energy, "open_run_data", lambda cfg: (SimpleNamespace(train=[], val=[], vocab_size=65), 72, 1))
    monkeypatch.setattr(energy, "Engine", lambda *a, **k: eng)
    monkeypatch.setattr(energy, "idle_watts", lambda: 70.0)
    watch = SimpleNamespace(stop=lambda: "SM clock 1980 -> 1650 MHz")
    monkeypatch.setattr(energy, "ClockWatch", lambda ordinal=0: watch)
    monkeypatch.setattr(energy, "energy_per_run", lambda run, sync, s: {"runs": 9, "ms": 4.0, "mj": 2800.0,
                                                                        "watts": 700.0})
    monkeypatch.setattr(energy, "launch_times", lambda rt, p: [(r, 0.5 + i) for i, r in enumerate(recs)])
    asked = {}

    def graphed(rt, record, ms, seconds):
        asked[ms] = seconds
        return {"runs": 100, "ms": ms, "mj": 600.0 * ms, "watts": 600.0}

    monkeypatch.setattr(energy, "energy_graphed", graphed)
    energy.main(["configs/tiny.yaml", "--label_seconds=0.25"])
    out = capsys.readouterr().out
    assert asked == {0.5 + 3.5: 0.25, 2.5: 0.25}                  # matmul[a]: 0.5 + 3.5 ms; ln<6>: 2.5
    assert "step:    4.000 ms    2.800 J   700 W  (9 steps)" in out and "SM clock 1980 -> 1650 MHz" in out
    assert "matmul[a] | gemm<1> gemm<2>" in out and "ln<6> | ln<6>" in out and "wait" not in out
