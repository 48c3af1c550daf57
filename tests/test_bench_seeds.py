"""bench/seeds.py: group parsing, the torch script's patched copy, and the whole scheduler on the
float64 reference backend (no GPU: --gpus 2 only names the CUDA_VISIBLE_DEVICES slots)."""
import json
import math
import os

import pytest

from bench import seeds


def test_parse_seeds_and_groups():
    assert seeds.parse_seeds("1-3,7") == [1, 2, 3, 7]
    g = seeds.parse_group("tf32=configs/ctx256_tf32.yaml:1-2:fp32_gemm=ffma,batch_size=32")
    assert g == dict(label="tf32", kind="ours", config="configs/ctx256_tf32.yaml", seeds=[1, 2],
                     overrides=["--fp32_gemm=ffma", "--batch_size=32"])
    t = seeds.parse_group("torch=torch:ref.py:5:0.1")
    assert (t["kind"], t["script"], t["seeds"], t["dropout"]) == ("torch", "ref.py", [5], 0.1)
    for bad in ("nolabel", "x=cfg.yaml", "x=torch:ref.py", "x=cfg.yaml:"):
        with pytest.raises(ValueError):
            seeds.parse_group(bad)


TORCH_LIKE = """g.manual_seed(1337)
torch.manual_seed(1337)
for it in range(steps):
    if (it + 1) % 250 == 0 or it + 1 == steps:
        pass
"""


def test_torch_copy_replaces_seed_and_cuts_the_loop(tmp_path):
    src = tmp_path / "ref.py"
    src.write_text(TORCH_LIKE)
    out = open(seeds.torch_copy(str(src), 7, 2750, str(tmp_path))).read()
    assert out.count("manual_seed(7)") == 2 and "1337" not in out
    assert "range(min(steps, 2750))" in out and "it + 1 == min(steps, 2750):" in out
    assert open(src).read() == TORCH_LIKE                     # the anchor script is left alone
    src.write_text(TORCH_LIKE.replace("torch.manual_seed(1337)", "torch.manual_seed(0)"))
    with pytest.raises(ValueError, match="manual_seed"):       # a changed script fails loudly
        seeds.torch_copy(str(src), 7, None, str(tmp_path))


def test_summary_statistics():
    runs = [dict(label="a", best_val=v) for v in (1.46, 1.47, 1.48)] + [dict(label="b", best_val=None)]
    a, b = seeds.summarize(runs, 1.465)
    assert a["n"] == 3 and math.isclose(a["mean"], 1.47) and math.isclose(a["std"], 0.01)
    assert (a["min"], a["max"], a["reach"]) == (1.46, 1.48, 1)
    assert b == dict(label="b", n=0)


def test_runs_until_a_step_and_keeps_the_schedule(tmp_path):
    """Two groups of reference-backend runs: each stops after --until steps with the config's own
    lr_decay_iters, seeds differ, the same seed reproduces, and the JSON has every history."""
    common = "backend=reference,eval_interval=5,eval_iters=2,lr_decay_iters=40"
    out_json = tmp_path / "seeds.json"
    rc = seeds.main([f"a=configs/tiny.yaml:1-2:{common}", f"b=configs/tiny.yaml:1:{common}",
                     "--until", "10", "--gpus", "2", "--per-gpu", "2", "--out", str(tmp_path / "runs"),
                     "--json", str(out_json), "--threshold", "9"])
    assert rc == 0
    res = json.loads(out_json.read_text())
    runs = {(r["label"], r["seed"]): r for r in res["runs"]}
    assert set(runs) == {("a", 1), ("a", 2), ("b", 1)}
    for r in runs.values():
        assert [h[0] for h in r["history"]] == [0, 5, 10] and r["rc"] == 0
        assert r["best_val"] == min(h[1] for h in r["history"])
    assert runs["a", 1]["history"] == runs["b", 1]["history"]          # same seed, same run
    assert runs["a", 1]["history"][-1] != runs["a", 2]["history"][-1]  # another seed, another run
    cfg = (tmp_path / "runs" / "a_seed1" / "config.yaml").read_text()
    assert "max_iters: 10" in cfg and "lr_decay_iters: 40" in cfg
    assert [s["n"] for s in res["summary"]] == [2, 1] and res["summary"][0]["reach"] == 2


def test_group_from_another_checkout(tmp_path):
    tree = tmp_path / "old"
    tree.mkdir()
    (tree / "train.py").write_text("")
    g = seeds.parse_group(f"old@{tree}=configs/tiny.yaml:3:backend=reference")
    assert g["tree"] == str(tree) and g["config"] == str(tree / "configs" / "tiny.yaml")
    argv, env, run_dir = seeds.job_command(g, 3, None, str(tmp_path / "runs"))
    assert argv[1] == str(tree / "train.py") and argv[2] == g["config"]
    assert env["PYTHONPATH"].split(":")[0] == str(tree)
    for bad in (f"old@{tmp_path / 'none'}=configs/tiny.yaml:1",      # no train.py there
                "old@=configs/tiny.yaml:1", f"t@{tree}=torch:ref.py:1"):
        with pytest.raises(ValueError):
            seeds.parse_group(bad)


def test_paired_differences(tmp_path):
    a = {1: 1.47, 2: 1.46, 3: 1.48}
    b = {2: 1.47, 3: 1.47, 4: 1.40}
    row = seeds.paired(a, b)
    assert row["seeds"] == [2, 3] and row["n"] == 2
    assert math.isclose(row["mean"], 0.0, abs_tol=1e-12)
    assert math.isclose(row["std"], math.sqrt(2) * 0.01) and math.isclose(row["se"], 0.01)
    f = tmp_path / "earlier.json"
    f.write_text(json.dumps(dict(runs=[dict(label="x", seed=s, best_val=v) for s, v in a.items()])))
    assert seeds.best_vals(f"{f}:x", []) == a
    assert seeds.best_vals("y", [dict(label="y", seed=5, best_val=1.5)]) == {5: 1.5}
    with pytest.raises(ValueError, match="no finished runs"):
        seeds.best_vals(f"{f}:z", [])


def test_runs_another_checkout_paired_with_this_one(tmp_path, capsys):
    """A checkout whose train.py announces itself and then runs ours: its runs go through its own
    train.py with its directory first on PYTHONPATH, train the same seed to the same history, and
    --paired reports a zero difference."""
    root = seeds.ROOT
    tree = tmp_path / "old"
    (tree / "configs").mkdir(parents=True)
    (tree / "configs" / "tiny.yaml").write_text(open(f"{root}/configs/tiny.yaml").read())
    (tree / "train.py").write_text(
        "import os, runpy, sys\n"
        "print('tree train.py; PYTHONPATH', os.environ['PYTHONPATH'].split(os.pathsep)[0])\n"
        f"sys.argv[0] = {os.path.join(root, 'train.py')!r}\n"
        f"sys.path.insert(0, {root!r})\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    common = "backend=reference,eval_interval=5,eval_iters=2,lr_decay_iters=40"
    out_json = tmp_path / "seeds.json"
    rc = seeds.main([f"new=configs/tiny.yaml:1:{common}", f"old@{tree}=configs/tiny.yaml:1:{common}",
                     "--until", "5", "--gpus", "1", "--out", str(tmp_path / "runs"),
                     "--json", str(out_json), "--paired", "new,old"])
    assert rc == 0
    res = json.loads(out_json.read_text())
    runs = {r["label"]: r for r in res["runs"]}
    assert runs["old"]["history"] == runs["new"]["history"]
    log = (tmp_path / "runs" / "old_seed1" / "run.log").read_text()
    assert f"tree train.py; PYTHONPATH {tree}" in log
    assert res["paired"][0]["n"] == 1 and res["paired"][0]["mean"] == 0.0
    assert "paired old - new over 1 seeds: mean +0.0000" in capsys.readouterr().out
