"""Exit-loop benchmark: how often a world dies at exit, by how its script ends.

    python -m benchmarks.exit_loop --worlds 70 --json out.json                  # 70 worlds each of N, A, B
    python -m benchmarks.exit_loop --worlds 70 --reproduce --old-worlds 20      # and 20 each of A0 and C

Each world is 2 or 3 fresh processes forming a Gloo process group on loopback (torchrun's
environment: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, ``init_method="env://"``). Every rank
trains a small model for a few steps (two micro-steps each), then the script ends one of five
ways -- the last lines of a user's script:

    N   closed    engine.close(destroy_group=True)                 (the guaranteed clean end)
    A   close     engine.close(); dist.destroy_process_group()     (what scripts write)
    B   bare      dist.destroy_process_group() with the engine still referenced (a global)
    A0  unhooked  A with ``teardown.release_dead_groups`` taken out of ``atexit``: the code
                  before that hook (--reproduce)
    C   ddp       DistributedDataParallel, bare dist.destroy_process_group() (the reference; --reproduce)

and the process exits normally (the interpreter's own shutdown, where a Gloo thread still
running can abort the process with "terminate called without an active exception":
``workers/zero/teardown.py``). The model, the optimizer, the last batch and loss stay module
globals until then, as in a script. A world *fails* when any rank exits nonzero, dies of a signal,
mentions "terminate called" on stderr, or does not finish within ``--timeout`` seconds. Each rank
also reports how many OS threads it has at ``atexit`` time -- after the engine's own ``atexit``
function, just before interpreter shutdown begins -- beyond those it had before
``init_process_group``, torch's intra-op pool started before (``thr.left``): the Gloo workers, transport loop and store threads that
would run into interpreter shutdown -- the abort's precondition, which the old endings meet in
every world while the abort itself is a race. The engine worlds cycle through stages 0-3, with
and without ``offload_optimizer`` (stages 1-3), at world sizes 2 and 3; the endings are
interleaved (N, A, B, C, N, ...) so that a quiet or a busy moment of the machine is shared.

[Note: forked ranks, real exits]
Importing torch costs seconds of CPU; a world of fresh interpreters would spend most of its
time there. So the parent imports torch once and *forks* every rank (``os.fork`` before any
thread or torch op exists in the parent). A forked rank returns out of ``main()`` to module
level, runs its script there -- the engine a module global, as in a user's script -- and ends
through the normal interpreter exit (``Py_Finalize`` + ``exit()``), never ``os._exit``, so it
tears down exactly as a ``torchrun``-launched script does. ``--exec`` launches every rank as
``python -m benchmarks.exit_loop --rank ...`` instead (slower; same results expected).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from workers.zero import ZeroConfig, ZeroEngine, teardown

ENDINGS = ("closed", "close", "bare", "unhooked", "ddp")
OLD_ENDINGS = ("unhooked", "ddp")  # --reproduce
LABELS = {"closed": "N: close(destroy_group=True)", "close": "A: engine.close() + destroy",
          "bare": "B: bare destroy, engine alive", "unhooked": "A0: A without the exit hook",
          "ddp": "C: DDP, bare destroy"}
#: (stage, offload) of the engine worlds, cycled through
ENGINE_CONFIGS = [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]
STEPS, MICRO = 3, 2
BUCKET_MB = 0.01  # 10 KB buckets: several per model, as the outside harness ran

# ranks keep what they built here, alive until the interpreter exits (a user's script's globals)
_KEEP: list = []


@dataclass
class World:
    index: int
    ending: str
    world_size: int
    stage: Optional[int] = None  # None: DDP
    offload: bool = False
    exit_codes: list = field(default_factory=list)  # per rank; negative: killed by that signal
    terminate_called: bool = False
    threads_left: int = 0  # most OS threads any rank had at atexit beyond those before init_process_group
    thread_names: list = field(default_factory=list)  # those threads' names, over the ranks
    timed_out: bool = False
    seconds: float = 0.0
    stderr_tail: str = ""

    @property
    def failed(self) -> bool:
        return self.timed_out or self.terminate_called or any(c != 0 for c in self.exit_codes)


def plan(counts: dict[str, int]) -> list[World]:
    """Interleaved endings: N, A, B, A0, C, N, A, ... until each ending has its count."""
    counts = dict(counts)
    out: list[World] = []
    k = 0
    while any(counts.values()):
        for ending in ENDINGS:
            if counts[ending] == 0:
                continue
            counts[ending] -= 1
            world_size = 2 + (k // len(ENGINE_CONFIGS)) % 2
            stage, offload = ENGINE_CONFIGS[k % len(ENGINE_CONFIGS)] if ending != "ddp" else (None, False)
            out.append(World(len(out), ending, world_size, stage, offload))
        k += 1
    return out


# -- one rank ----------------------------------------------------------------------------------------

class Net(torch.nn.Module):
    """Embedding, a ModuleList of blocks (stage 3's units), a head: a transformer's layout, tiny."""

    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.emb = torch.nn.Embedding(64, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth))
        self.head = torch.nn.Linear(width, 64)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def rank_main(ending: str, stage: Optional[int], offload: bool) -> None:
    """Train a few steps and end the way ``ending`` says; the process then exits normally."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if int(os.environ.get(THREADS_ENV, "0")):
        torch.set_num_threads(int(os.environ[THREADS_ENV]))
    # torch's intra-op pool (OpenMP: its threads never take the GIL) is started before counting, so
    # that only what the process group and the engine leave is counted, whatever --torch-threads
    torch.mm(torch.ones(256, 256), torch.ones(256, 256))
    # registered first, so it runs last of the atexit functions (after the engine's): the threads
    # that interpreter shutdown will find
    atexit.register(_report_threads, set(_os_threads()))
    _train_and_end(ending, stage, offload)


def _report_threads(before: set[str]) -> None:
    """Print how many threads the rank has beyond ``before`` (thread ids), and their names."""
    names = []
    for task in sorted(set(_os_threads()) - before):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # it ended meanwhile
            continue
    print(f"{THREADS_MARK}{len(names)} {','.join(names)}", file=sys.stderr, flush=True)


THREADS_MARK = "exit-loop threads left: "
THREADS_ENV = "EXIT_LOOP_TORCH_THREADS"  # --torch-threads, for the ranks


def _os_threads() -> list[str]:
    """The process's OS threads' ids (Python's and C++'s: Gloo's workers, its transport loop, the store's)."""
    return os.listdir("/proc/self/task")


def _train_and_end(ending: str, stage: Optional[int], offload: bool) -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    if ending == "ddp":
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        _KEEP.extend([ddp, optimizer])
        for step in range(STEPS):
            for micro in range(MICRO):
                x, y = _batch(step, micro, rank)
                with ddp.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                    loss = ddp(x, y)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _KEEP.extend([x, y, loss])
        dist.destroy_process_group()
        return

    config = ZeroConfig(stage=stage, precision="fp32", bucket_mb=BUCKET_MB, offload_optimizer=offload)
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), config)
    _KEEP.append(engine)
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = _batch(step, micro, rank)
            loss = engine(x, y)
            engine.backward(loss, sync=micro == MICRO - 1)
        engine.step()
    _KEEP.extend([x, y, loss])
    if ending == "closed":
        engine.close(destroy_group=True)
        return
    if ending in ("close", "unhooked"):
        engine.close()
    dist.destroy_process_group()
    if ending == "unhooked":
        atexit.unregister(teardown.release_dead_groups)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randint(0, 64, (4, 8), generator=g)
    return x, (x * 5 + 3) % 64


# -- the driver --------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(world: World, rank: int, port: int, torch_threads: int) -> dict[str, str]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
           "WORLD_SIZE": str(world.world_size), "GLOO_SOCKET_IFNAME": "lo", THREADS_ENV: str(torch_threads)}
    return {**env, "OMP_NUM_THREADS": str(torch_threads)} if torch_threads else env


class _Running:
    """A launched world: its ranks' pids (or Popen objects) and stderr files."""

    def __init__(self, world: World, ranks: list, logs: list[str], started: float):
        self.world, self.ranks, self.logs, self.started = world, ranks, logs, started
        self.codes: dict[int, int] = {}

    def poll(self) -> bool:
        for r, proc in enumerate(self.ranks):
            if r in self.codes:
                continue
            if isinstance(proc, subprocess.Popen):
                code = proc.poll()
            else:
                pid, status = os.waitpid(proc, os.WNOHANG)
                code = None if pid == 0 else os.waitstatus_to_exitcode(status)
            if code is not None:
                self.codes[r] = code
        return len(self.codes) == len(self.ranks)

    def kill(self) -> None:
        for r, proc in enumerate(self.ranks):
            if r not in self.codes:
                if isinstance(proc, subprocess.Popen):
                    proc.kill()
                    self.codes[r] = proc.wait()
                else:
                    os.kill(proc, signal.SIGKILL)
                    self.codes[r] = os.waitstatus_to_exitcode(os.waitpid(proc, 0)[1])

    def finish(self, timed_out: bool) -> World:
        w = self.world
        w.exit_codes = [self.codes[r] for r in range(len(self.ranks))]
        w.timed_out = timed_out
        w.seconds = round(time.monotonic() - self.started, 2)
        text = ""
        for path in self.logs:
            with open(path, errors="replace") as f:
                text += f.read()
            os.unlink(path)
        w.terminate_called = "terminate called" in text
        reports = [line[len(THREADS_MARK):].split(" ", 1) for line in text.splitlines()
                   if line.startswith(THREADS_MARK)]
        w.threads_left = max([int(n) for n, _ in reports] or [-1])
        w.thread_names = sorted({name for _, names in reports for name in names.split(",") if name})
        if w.failed:
            w.stderr_tail = text[-2000:]
        return w


def launch(world: World, logdir: str, use_exec: bool, torch_threads: int):
    """Start every rank of ``world``. In a forked rank this returns ``(ending, stage, offload)``."""
    port = _free_port()
    ranks, logs = [], []
    for rank in range(world.world_size):
        log_path = os.path.join(logdir, f"w{world.index}r{rank}.log")
        logs.append(log_path)
        env = _rank_env(world, rank, port, torch_threads)
        if use_exec:
            cmd = [sys.executable, "-m", __spec__.name, "--rank", world.ending, str(world.stage),
                   str(int(world.offload))]
            with open(log_path, "wb") as log:
                ranks.append(subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                              stderr=log))
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: stderr to its log, back to module level to run and exit normally
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.environ.update(env)
            os.setpgid(0, 0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            return world.ending, world.stage, world.offload
        ranks.append(pid)
    return _Running(world, ranks, logs, time.monotonic())


def table(worlds: list[World]) -> str:
    rows = [f"{'ending':34s} {'worlds':>6s} {'failed':>6s} {'thr.left':>8s}   failures by (stage, offload, N)"]
    for ending in ENDINGS:
        mine = [w for w in worlds if w.ending == ending]
        if not mine:
            continue
        bad = [w for w in mine if w.failed]
        where: dict[str, int] = {}
        for w in bad:
            key = f"ddp N={w.world_size}" if w.stage is None else \
                f"s{w.stage}{'+off' if w.offload else ''} N={w.world_size}"
            where[key] = where.get(key, 0) + 1
        left = sum(w.threads_left != 0 for w in mine)  # -1: a rank died before it could count
        rows.append(f"{LABELS[ending]:34s} {len(mine):6d} {len(bad):6d} {left:8d}   "
                    + ", ".join(f"{k}: {v}" for k, v in sorted(where.items())))
    names = {LABELS[e].split(":")[0]: sorted({n for w in worlds if w.ending == e for n in w.thread_names})
             for e in ENDINGS}
    rows += [f"threads left at exit in {e}: {', '.join(n)}" for e, n in names.items() if n]
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, default=70, help="worlds of each ending N, A, B")
    p.add_argument("--reproduce", action="store_true",
                   help="also run A0 and C (--old-worlds each), interleaved with N, A, B")
    p.add_argument("--old-worlds", type=int, default=None, help="worlds of each old ending (default: --worlds)")
    p.add_argument("--jobs", type=int, default=1, help="worlds running at once")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a world counts as hung")
    p.add_argument("--exec", dest="use_exec", action="store_true", help="exec fresh interpreters, no fork")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="each rank's torch.set_num_threads (0: torch's default)")
    p.add_argument("--json", help="write every world's result here")
    p.add_argument("--rank", nargs=3, metavar=("ENDING", "STAGE", "OFFLOAD"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        ending, stage, offload = args.rank
        return ending, None if stage == "None" else int(stage), offload == "1"

    old = (args.worlds if args.old_worlds is None else args.old_worlds) if args.reproduce else 0
    counts = {e: old if e in OLD_ENDINGS else args.worlds for e in ENDINGS}
    for e, n in counts.items():
        if n < 0:
            raise ValueError(f"--worlds and --old-worlds must be >= 0, got {n} for ending {e}")
    todo = plan(counts)
    parent = os.getpid()
    signal.signal(signal.SIGTERM, _interrupted)  # a stopped run still kills its ranks and keeps its JSON
    done: list[World] = []
    running: list[_Running] = []
    t0 = time.monotonic()
    logdir = tempfile.mkdtemp(prefix="exit-loop-")  # not a context manager: a forked rank leaves through here
    try:
        while todo or running:
            while todo and len(running) < args.jobs:
                started = launch(todo.pop(0), logdir, args.use_exec, args.torch_threads)
                if isinstance(started, tuple):
                    return started  # a forked rank
                running.append(started)
            for r in list(running):
                timed_out = time.monotonic() - r.started > args.timeout
                if timed_out:
                    r.kill()
                if r.poll():
                    running.remove(r)
                    w = r.finish(timed_out)
                    done.append(w)
                    if args.json:  # after every world: a run stopped early still leaves its numbers
                        write_json(args.json, done, time.monotonic() - t0, args)
                    if w.failed:
                        print(f"world {w.index} ({w.ending}, stage {w.stage}, offload {w.offload}, "
                              f"N={w.world_size}) FAILED: exit codes {w.exit_codes}"
                              f"{' timed out' if w.timed_out else ''}", flush=True)
            time.sleep(0.02)
    finally:
        if os.getpid() == parent:  # not in a forked rank on its way out
            for r in running:
                r.kill()
            shutil.rmtree(logdir, ignore_errors=True)
    wall = time.monotonic() - t0
    done.sort(key=lambda w: w.index)
    print(table(done))
    print(f"{len(done)} worlds in {wall:.0f} s (jobs={args.jobs}, {'exec' if args.use_exec else 'fork'}, "
          f"torch threads {args.torch_threads or 'default'}; load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        write_json(args.json, done, wall, args)
    return None


def _interrupted(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write_json(path: str, done: list[World], wall: float, args: argparse.Namespace) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"wall_s": round(wall, 1), "jobs": args.jobs, "launcher": "exec" if args.use_exec else "fork",
                   "torch_threads": args.torch_threads, "bucket_mb": BUCKET_MB, "steps": STEPS,
                   "torch": torch.__version__, "load": os.getloadavg(),
                   "summary": {e: {"worlds": sum(w.ending == e for w in done),
                                   "failed": sum(w.ending == e and w.failed for w in done),
                                   "threads_left": sum(w.ending == e and w.threads_left != 0 for w in done)}
                               for e in ENDINGS},
                   "worlds": [{**asdict(w), "failed": w.failed} for w in sorted(done, key=lambda w: w.index)]},
                  f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    _role = main()
    if _role is not None:
        rank_main(*_role)  # a rank: its globals live until the interpreter's own exit
