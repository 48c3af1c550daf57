"""What the entry points share: argument splitting, --help, one-line fatal errors.

The top of the layers: only the scripts (and bench/) import this module; it imports the layers whose errors it turns
into one line (`guarded`). The errors the layers raise for that live in gptcuda/errors.py."""
from __future__ import annotations

import sys

from gptcuda.errors import RunError, UsageError, describe_os_error   # the scripts import them from here too
from gptcuda.config import ConfigError
from gptcuda.runtime.driver import CudaError, NoDeviceError
from gptcuda.model.checkpoint import CheckpointError
from gptcuda.model.memory import PlanTooLarge
from gptcuda.data.shards import DataError

HELP_FLAGS = ("-h", "--help")


def split_args(argv, flags=(), options=()):
    """argv -> (config path or None, overrides, flags set, options dict).

    `flags` are bare switches (--plan); `options` take a value (--out_dir DIR or --out_dir=DIR);
    any other --key=value (or --key value) is a config override, returned as "--key=value". -h / --help (where an argument, not a value, is
    expected) add "help" to the flags set."""
    path, overrides, seen, opts = None, [], set(), {}
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a[2:].split("=", 1)[0] if a.startswith("--") else None
        if a in HELP_FLAGS:
            seen.add("help")
        elif name in flags:
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
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if ("=" not in a and nxt is not None and not nxt.startswith("--") and nxt not in HELP_FLAGS
                    and not (path is None and nxt.endswith((".yaml", ".yml")))):
                overrides.append(f"{a}={nxt}")       # --key value, as argparse users expect
                i += 1
            else:
                overrides.append(a)
        elif path is None and a.endswith((".yaml", ".yml")):
            path = a
        else:
            raise UsageError(f"unexpected argument {a!r} (config overrides are --key=value; --help lists them)")
        i += 1
    return path, overrides, seen, opts


def wants_help(argv) -> bool:
    """Whether argv asks for --help / -h (checked before anything else can fail)."""
    return any(a in HELP_FLAGS for a in argv)


def _yaml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    return repr(v)


def config_help() -> str:
    """Every config key with its type, default and (from gptcuda/config.py) its comment, one a line."""
    from gptcuda.config import config_keys
    rows = [(f"--{k}", t, _yaml_value(d), doc) for k, t, d, doc in config_keys()]
    wk = max(len(r[0]) for r in rows)
    wt = max(len(r[1]) for r in rows)
    wd = max(len(r[2]) for r in rows)
    return "\n".join(f"  {k:<{wk}}  {t:<{wt}}  {d:<{wd}}  {doc}".rstrip() for k, t, d, doc in rows)


def format_help(doc: str, options=(), config: bool = True) -> str:
    """The usage text: doc (a script's docstring), its options (pairs (name, text), or a mapping;
    a name is printed as given, e.g. "--resume" or "--temp T"), then the config keys."""
    parts = [(doc or "").strip("\n")]
    items = list(options.items()) if hasattr(options, "items") else list(options)
    items.append(("-h, --help", "print this help and exit"))
    w = max(len(n) for n, _ in items)
    parts.append("options:\n" + "\n".join(f"  {n:<{w}}  {t}" for n, t in items))
    if config:
        parts.append("config keys, --key=value (defaults, then the YAML file, then these; gptcuda/config.py):\n"
                     + config_help())
    return "\n\n".join(parts) + "\n"


def print_help(doc: str, options=(), config: bool = True, file=None) -> int:
    """Print format_help(...) to stdout; returns 0, the exit code of --help."""
    (file or sys.stdout).write(format_help(doc, options, config))
    return 0


def error_line(msg: str) -> str:
    return "error: " + " ".join(str(msg).split())


def fatal(msg: str, code: int = 2):
    print(error_line(msg), file=sys.stderr)
    sys.exit(code)


def guarded(main):
    """Run main(argv) and return its exit code; known failures become one line on stderr and exit code 2
    (no traceback), an interrupt outside the training loop exit code 130."""
    def wrapper(argv=None):
        def fail(msg, code=2):
            sys.stdout.flush()
            print(error_line(msg), file=sys.stderr)
            return code
        try:
            return main(sys.argv[1:] if argv is None else argv)
        except NoDeviceError as e:
            return fail(f"{e}. Use --backend=reference to run on the CPU.")
        except (ConfigError, CheckpointError, UsageError, PlanTooLarge, DataError, RunError) as e:
            return fail(str(e))
        except CudaError as e:
            return fail(f"CUDA: {e}")
        except OSError as e:              # FileNotFoundError, PermissionError, ENOSPC, ...
            if e.filename is None and e.errno is None:
                return fail(str(e))
            return fail(describe_os_error(e))
        except KeyboardInterrupt:
            sys.stdout.flush()
            print("interrupted", file=sys.stderr)
            return 130
    wrapper.__wrapped__ = main
    return wrapper
