"""What the entry points share: argument splitting, one-line fatal errors, run directories."""
from __future__ import annotations

import glob
import os
import sys

from .checkpoint import CheckpointError
from .config import ConfigError
from .driver import CudaError, NoDeviceError
from .memory import PlanTooLarge
from .shards import DataError


class UsageError(Exception):
    pass


def split_args(argv, flags=(), options=()):
    """argv -> (config path or None, overrides, flags set, options dict).

    `flags` are bare switches (--plan); `options` take a value (--out_dir DIR or --out_dir=DIR);
    any other --key=value is a config override."""
    path, overrides, seen, opts = None, [], set(), {}
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a[2:].split("=", 1)[0] if a.startswith("--") else None
        if name in flags:
            if "=" in a:
                raise UsageError(f"--{name} takes no value")
            seen.add(name)
        elif name in options:
            if "=" in a:
                opts[name] = a.split("=", 1)[1]
            else:
                if i + 1 >= len(argv):
                    raise UsageError(f"--{name} needs a value")
                opts[name] = argv[i + 1]
                i += 1
        elif a.startswith("--"):
            overrides.append(a)
        elif path is None and a.endswith((".yaml", ".yml")):
            path = a
        else:
            raise UsageError(f"unexpected argument {a!r} (config overrides are --key=value)")
        i += 1
    return path, overrides, seen, opts


def fatal(msg: str, code: int = 2):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def guarded(main):
    """Run main(argv); known failures become one line on stderr and exit code 2 (no traceback)."""
    def wrapper(argv=None):
        try:
            return main(sys.argv[1:] if argv is None else argv)
        except NoDeviceError as e:
            fatal(f"{e}. Use --backend=reference to run on the CPU.")
        except (ConfigError, CheckpointError, UsageError, PlanTooLarge, DataError, FileNotFoundError) as e:
            fatal(str(e))
        except CudaError as e:
            fatal(f"CUDA: {e}")
    return wrapper


def latest_run(root: str = "out") -> str | None:
    """The most recently written run directory under root (one holding a checkpoint)."""
    runs = [os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "*.ckpt"))]
    if not runs:
        return None
    return max(set(runs), key=lambda d: max(os.path.getmtime(p) for p in glob.glob(os.path.join(d, "*.ckpt"))))
