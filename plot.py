"""Plot training runs from their metrics.jsonl: losses, learning rate, gradient norm, tokens/s, HellaSwag.

    python plot.py out/gpt2_tf32                           # -> plot.png
    python plot.py out/gpt2_tf32 out/gpt2_bf16 --out runs.svg --logx
    python plot.py out/run/metrics.jsonl --out run.html    # an HTML page holding the SVG

Each RUN (a run directory or its metrics.jsonl) is one colour, named by its directory; the panels are
train and val loss against steps and against tokens, the learning rate, the gradient norm, tokens/s and,
where a run scored it, HellaSwag acc_norm. Tokens are counted from the records (tokens/s x ms a step).
Needs matplotlib (pip install -e ".[plot]"). An existing --out file is refused unless --overwrite.
Exit codes: 0 written, 2 a usage error, a run without metrics, or matplotlib missing (one line on stderr).
"""
import io
import json
import os
import sys

from gptcuda.cli import UsageError, guarded, print_help, split_args

OPTIONS = {
    "--out FILE": "the picture: .png, .svg or .html (default plot.png)",
    "--logx": "steps and tokens on a log scale",
    "--overwrite": "replace an existing --out file",
}
FORMATS = (".png", ".svg", ".html")


def read_run(path: str) -> tuple[str, list]:
    """(name, records) of a run directory or a metrics.jsonl; a torn last line (a killed writer) is left out."""
    f = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        raise UsageError(f"{path}: no metrics.jsonl (name a run directory or its metrics.jsonl)")
    with open(f, encoding="utf-8") as fh:
        lines = [l for l in fh.read().split("\n") if l.strip()]
    recs = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines):
                break
            raise UsageError(f"{f}:{i}: not a JSON record") from None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            recs.append(rec)
    if not recs:
        raise UsageError(f"{f} holds no records yet")
    name = os.path.basename(os.path.dirname(os.path.abspath(f)))
    return name, recs


def series(recs, key):
    """(steps, values) of the records holding key."""
    pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def tokens_per_step(recs) -> float | None:
    """Tokens an optimizer step trains, from a step record: tok_s x ms / 1000 (None without one)."""
    for r in recs:
        if r.get("tok_s") and r.get("ms"):
            return r["tok_s"] * r["ms"] / 1e3
    return None


PANELS = (("loss against steps", "step", "loss"), ("loss against tokens", "tokens", "loss"),
          ("learning rate", "step", "lr"), ("gradient norm", "step", "grad_norm"),
          ("tokens/s", "step", "tokens/s"), ("HellaSwag acc_norm", "step", "acc_norm"))


def figure(runs, logx: bool = False):
    """A matplotlib Figure of the runs [(name, records)]: the PANELS, one colour a run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    hella = any("hellaswag" in r for _, recs in runs for r in recs)
    panels = PANELS if hella else PANELS[:5]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), squeeze=False)
    axes = axes.ravel()
    for ax, (title, x, y) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        if logx:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    if not hella:
        axes[5].set_visible(False)
    for i, (name, recs) in enumerate(runs):
        c = f"C{i % 10}"
        per = tokens_per_step(recs)
        for key, style, label in (("loss", "-", "train"), ("eval_train", "--", "eval train"),
                                  ("eval_val", "o-", "val")):
            s, v = series(recs, key)
            if not s:
                continue
            kw = dict(color=c, label=f"{name} {label}", lw=0.8 if key == "loss" else 1.5,
                      alpha=0.5 if key == "loss" else 1.0, ms=3)
            axes[0].plot(s, v, style, **kw)
            if per:
                axes[1].plot([k * per for k in s], v, style, **kw)
        for ax, key in ((axes[2], "lr"), (axes[3], "grad_norm"), (axes[4], "tok_s")):
            s, v = series(recs, key)
            ax.plot(s, v, color=c, label=name, lw=1)
        if hella:
            s, v = series(recs, "hellaswag")
            axes[5].plot(s, v, "o-", color=c, label=name, ms=3)
    for ax in axes[:6]:
        if ax.get_visible() and ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(" vs ".join(name for name, _ in runs))
    fig.tight_layout()
    return fig


def render(fig, ext: str) -> bytes:
    """The figure as a file's bytes: PNG, SVG, or an HTML page holding the SVG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png" if ext == ".png" else "svg", dpi=110)
    if ext != ".html":
        return buf.getvalue()
    svg = buf.getvalue().decode("utf-8")
    svg = svg[svg.index("<svg"):]
    title = fig._suptitle.get_text() if fig._suptitle is not None else "runs"
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title></head>\n<body>\n"
            f"{svg}\n</body></html>\n").encode("utf-8")


@guarded
def main(argv):
    runs = [a for a in argv if not a.startswith("-")]
    out_i = [i for i, a in enumerate(argv) if a == "--out"]
    if out_i and out_i[0] + 1 < len(argv):
        runs.remove(argv[out_i[0] + 1])               # the value of --out FILE is no run
    rest = [a for a in argv if a not in runs]
    _, overrides, flags, opts = split_args(rest, flags=("logx", "overwrite"), options=("out",))
    if "help" in flags:
        return print_help(__doc__, OPTIONS, config=False)
    if overrides:
        raise UsageError(f"unknown option {overrides[0]} (options: --out, --logx, --overwrite)")
    if not runs:
        raise UsageError("name at least one run: plot.py RUN [RUN ...] [--out FILE.png|.svg|.html]")
    out = opts.get("out", "plot.png")
    ext = os.path.splitext(out)[1].lower()
    if ext not in FORMATS:
        raise UsageError(f"--out {out}: the picture is {', '.join(FORMATS)}")
    if os.path.exists(out) and "overwrite" not in flags:
        raise UsageError(f"--out {out} exists: pass --overwrite to replace it, or name another file")
    data = [read_run(r) for r in runs]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("plot.py needs matplotlib: pip install -e \".[plot]\"") from None
    from gptcuda.files import atomic_open
    body = render(figure(data, logx="logx" in flags), ext)
    with atomic_open(out, "wb") as f:
        f.write(body)
    print(f"wrote {out}: {', '.join(name for name, _ in data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
