"""Deliberate faults, for proving that the checks catch them (gradcheck.py --break=...).

`BREAKABLE` names what can be broken; `broken` holds what is broken in this process. The
reference backend and the CUDA launchers consult it when they build an op, so a broken
variant is compiled (a -D define) or chosen explicitly, never patched in at run time.
"""
BREAKABLE = {
    "layernorm": "layernorm backward without the x_hat * mean(dx_hat * x_hat) term",
}
broken: set = set()


def set_broken(names):
    unknown = [n for n in names if n not in BREAKABLE]
    if unknown:
        raise ValueError(f"--break: unknown fault {unknown[0]!r} (known: {', '.join(BREAKABLE)})")
    broken.clear()
    broken.update(names)
