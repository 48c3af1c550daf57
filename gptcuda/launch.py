"""Start one process per GPU for data-parallel training.

    python -m gptcuda.launch --nproc 2 train.py configs/tiny.yaml [--key=value ...]
    python -m gptcuda.launch --nproc 8 --rdzv file --rdzv_dir /shared/tmp train.py CONFIG
    python -m gptcuda.launch --nnodes 2 --node_rank 0 --master_addr HOST0 --nproc 8 train.py CONFIG

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
GPTCUDA_RDZV (tcp | file), GPTCUDA_RDZV_DIR, GPTCUDA_RUN_ID (new for every launch; with several
nodes the one in the environment, else MASTER_ADDR-MASTER_PORT, so that every node's launcher agrees),
NCCL_NVLS_ENABLE=0 and PYTHONUNBUFFERED=1; gptcuda.dist reads them (rank 0 hands out the NCCL id on
MASTER_ADDR:MASTER_PORT, a free loopback port by default). A command ending in .py runs under this
Python; anything else runs as given (`-- CMD ...`).

Every output line is prefixed with its rank ("[1] ..."; --no_prefix passes output through).
SIGINT, SIGTERM and SIGHUP are forwarded to every rank; ranks still running --grace seconds
later are killed. When a rank fails the others are stopped the same way (they would wait for it
in a collective forever). The exit code is the worst of the ranks' exit codes (a rank killed by a
signal counts as 128 + the signal), leaving out ranks that died of the launcher's SIGTERM or SIGKILL
after another rank failed.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

USAGE = ("usage: python -m gptcuda.launch --nproc N [--nnodes M --node_rank I] [--master_addr ADDR] "
         "[--master_port PORT] [--rdzv tcp|file] [--rdzv_dir DIR] [--grace SECONDS] [--no_prefix] "
         "SCRIPT.py [ARGS ...] | -- CMD [ARGS ...]")

OPTIONS = {"nproc": int, "nnodes": int, "node_rank": int, "master_addr": str, "master_port": int,
           "rdzv": str, "rdzv_dir": str, "grace": float}


class LaunchError(Exception):
    pass


def parse_args(argv):
    """argv -> (options dict, command list)."""
    opts = {"nnodes": 1, "node_rank": 0, "rdzv": "tcp", "grace": 30.0, "no_prefix": False}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("--"):
            break
        name, _, value = a[2:].partition("=")
        name = name.replace("-", "_")
        if name == "no_prefix":
            opts["no_prefix"] = True
            i += 1
            continue
        if name not in OPTIONS:
            raise LaunchError(f"unknown option {a!r}")
        if not _:
            if i + 1 >= len(argv):
                raise LaunchError(f"{a} needs a value")
            value = argv[i + 1]
            i += 1
        try:
            opts[name] = OPTIONS[name](value)
        except ValueError:
            raise LaunchError(f"--{name} takes a {OPTIONS[name].__name__}, got {value!r}") from None
        i += 1
    cmd = list(argv[i:])
    if not cmd:
        raise LaunchError("no command to run")
    if "nproc" not in opts:
        raise LaunchError("--nproc N is required (processes on this host, one per GPU)")
    if opts["nproc"] < 1 or opts["nnodes"] < 1:
        raise LaunchError("--nproc and --nnodes must be >= 1")
    if not 0 <= opts["node_rank"] < opts["nnodes"]:
        raise LaunchError(f"--node_rank {opts['node_rank']} must be in 0..{opts['nnodes'] - 1}")
    if opts["rdzv"] not in ("tcp", "file"):
        raise LaunchError(f"--rdzv must be tcp or file, got {opts['rdzv']!r}")
    if opts["nnodes"] > 1 and "master_addr" not in opts and opts["rdzv"] == "tcp":
        raise LaunchError("--nnodes > 1 needs --master_addr (the host of node rank 0)")
    if opts["nnodes"] > 1 and "master_port" not in opts and opts["rdzv"] == "tcp":
        raise LaunchError("--nnodes > 1 needs --master_port (the same on every node)")
    if opts["nnodes"] > 1 and opts["rdzv"] == "file" and "rdzv_dir" not in opts:
        raise LaunchError("--rdzv file on several nodes needs --rdzv_dir (a directory every node sees)")
    if not 0 < opts.get("master_port", 1) < 65536:
        raise LaunchError(f"--master_port {opts['master_port']} outside 1..65535")
    if cmd[0].endswith(".py"):
        cmd = [sys.executable] + cmd
    return opts, cmd


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rank_env(base: dict, opts: dict, local_rank: int, run_id: str) -> dict:
    n, nodes = opts["nproc"], opts["nnodes"]
    env = dict(base)
    env.update({
        "RANK": str(opts["node_rank"] * n + local_rank), "WORLD_SIZE": str(nodes * n),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": opts["master_addr"], "MASTER_PORT": str(opts["master_port"]),
        "GPTCUDA_RDZV": opts["rdzv"], "GPTCUDA_RUN_ID": run_id,
        "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1",
    })
    if opts.get("rdzv_dir"):
        env["GPTCUDA_RDZV_DIR"] = opts["rdzv_dir"]
    return env


def _die_with_parent():
    """In the child, before exec: get SIGKILL if the launcher dies (Linux), so that no rank is left
    waiting in a collective and holding its GPU."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except Exception:
        pass


def _pump(src, dst, prefix: bytes, lock):
    for line in iter(src.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            dst.write(prefix + line)
            dst.flush()
    src.close()


def exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


class Launch:
    def __init__(self, opts, cmd, out=None, err=None):
        self.opts, self.cmd = opts, cmd
        self.out = out or sys.stdout.buffer
        self.err = err or sys.stderr.buffer
        self.procs, self.threads = [], []
        self.stopped = set()                 # ranks the launcher stopped because another failed
        self.signalled_at = None
        self._lock = threading.Lock()

    def start(self):
        opts = self.opts
        if opts["rdzv"] == "tcp":
            opts.setdefault("master_addr", "127.0.0.1")
            opts.setdefault("master_port", free_port(opts["master_addr"]) if opts["nnodes"] == 1 else 29500)
        else:
            opts.setdefault("master_addr", "127.0.0.1")
            opts.setdefault("master_port", 29500)
            if not opts.get("rdzv_dir"):
                import tempfile
                opts["rdzv_dir"] = tempfile.gettempdir()
        if opts["nnodes"] > 1:                # the same on every node's launcher
            run_id = os.environ.get("GPTCUDA_RUN_ID") or f"{opts['master_addr']}-{opts['master_port']}"
        else:
            run_id = uuid.uuid4().hex
        pipe = None if opts["no_prefix"] else subprocess.PIPE
        width = len(str(opts["nproc"] * opts["nnodes"] - 1))
        for local in range(opts["nproc"]):
            env = rank_env(os.environ, opts, local, run_id)
            self.procs.append(subprocess.Popen(self.cmd, env=env, stdout=pipe, stderr=pipe, start_new_session=True,
                                               preexec_fn=_die_with_parent if sys.platform == "linux" else None))
        if pipe is not None:                  # threads only after every fork (preexec_fn)
            for local, p in enumerate(self.procs):
                rank = opts["node_rank"] * opts["nproc"] + local
                prefix = f"[{rank:>{width}}] ".encode()
                for src, dst in ((p.stdout, self.out), (p.stderr, self.err)):
                    t = threading.Thread(target=_pump, args=(src, dst, prefix, self._lock), daemon=True)
                    t.start()
                    self.threads.append(t)

    def signal_all(self, sig, ranks=None):
        for i, p in enumerate(self.procs):
            if (ranks is None or i in ranks) and p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.send_signal(sig)
                    except ProcessLookupError:
                        pass

    def forward(self, sig, _frame=None):
        self.signal_all(sig)
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    SETTLE_S = 2.0      # after a rank fails, the others get this long to report their own errors

    def wait(self) -> int:
        grace = self.opts["grace"]
        failed_at, termed = None, False
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            own_failure = any(c not in (None, 0) and i not in self.stopped for i, c in enumerate(codes))
            if own_failure and failed_at is None:
                failed_at = now
                running = {i for i, c in enumerate(codes) if c is None}
                self.stopped |= running
                with self._lock:
                    bad = [(i, exit_code(c)) for i, c in enumerate(codes) if c not in (None, 0)]
                    self.err.write(f"launch: rank(s) {[i for i, _ in bad]} failed (exit {[c for _, c in bad]}); "
                                   f"stopping rank(s) {sorted(running)}\n".encode())
                    self.err.flush()
            if failed_at is not None and not termed and now - failed_at >= self.SETTLE_S:
                termed = True
                self.signal_all(signal.SIGTERM, self.stopped)
            started = min(t for t in (failed_at, self.signalled_at) if t is not None) if (
                failed_at is not None or self.signalled_at is not None) else None
            if started is not None and now - started > grace:
                self.signal_all(signal.SIGKILL)
            time.sleep(0.05)
        for t in self.threads:
            t.join(timeout=5)
        ours = (-signal.SIGTERM, -signal.SIGKILL)
        own = [exit_code(p.returncode) for i, p in enumerate(self.procs)
               if not (i in self.stopped and p.returncode in ours)]
        return max(own) if own else max(exit_code(p.returncode) for p in self.procs)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts, cmd = parse_args(argv)
    except LaunchError as e:
        print(f"error: {e}\n{USAGE}", file=sys.stderr)
        return 2
    launch = Launch(opts, cmd)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, launch.forward) for s in handled}
    try:
        try:
            launch.start()
        except OSError as e:
            launch.signal_all(signal.SIGKILL)
            print(f"error: cannot start {cmd[0]!r}: {e}", file=sys.stderr)
            return 2
        return launch.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
