"""bench/energy.py on the GPU: the tiny bf16 config's step and every launch label measured (joules where the
board keeps a counter), the labels' times within the step's."""
import pytest

from bench import energy

pytestmark = pytest.mark.gpu


def test_energy_report_runs_on_the_tiny_config(capsys):
    energy.main(["configs/tiny.yaml", "--precision=bf16", "--attention=fused", "--vocab_multiple=8", "--seconds=0.2",
                 "--label_seconds=0.02", "--top=100"])
    out = capsys.readouterr().out.splitlines()
    step = next(line for line in out if line.startswith("step:"))
    labels = next(line for line in out if line.startswith("labels alone:"))
    step_ms, labels_ms = float(step.split()[1]), float(labels.split()[2])
    rows = out[out.index(next(line for line in out if line.lstrip().startswith("ms "))) + 1:]
    assert len(rows) >= 5 and all(float(r.split()[0]) > 0 for r in rows)
    # apart, each label pays its own launches and clock; the tiny step itself is mostly the host's feed
    assert 0 < labels_ms < 3 * step_ms
