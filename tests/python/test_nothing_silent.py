"""The main job when things go wrong: bad command lines (one message from the launcher, no
rank started), divergence (a clear stop, non-zero exit, no non-finite checkpoint), a launcher
killed (its ranks end), a write that fails (the path and the reason, on every rank; the
previous checkpoint stays the latest and loads), temporaries of an interrupted save removed.
Ranks disagreeing inside an op: test_agreement.py; a rank that dies or skips an op:
test_faults.py and test_train.py."""
import errno
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from rankpool import TRANSPORT_ENV, launcher_args, mpirun

import gridweave as gw
from test_train import ARGS

HERE = os.path.dirname(__file__)


def _cli(tmp_path, *extra, port=29701, timeout=200):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *ARGS, *launcher_args(), *extra],
                          capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("spec,needle", [
    (["--steps", "-1"], "steps must be a non-negative integer, got -1"),  # 0: a conversion (--init-from)
    (["--hidden", "30", "--heads", "4"], "hidden 30 does not split into 4 heads"),
    (["--microbatches", "0"], "microbatches must be a positive integer"),
    (["--lr", "nan"], "lr must be a finite positive number"),
    (["--lr", "-1"], "lr must be a finite positive number"),
    (["--batch", "6", "--dp", "4", "--pp", "2"], "batch 6 does not split into 4 dp shards"),
    (["--data", "BINARY"], "is not text (it holds NUL bytes)"),
    (["--data", "MISSING"], "no text corpus at"),
    (["--out", "FILE/run"], "is a file, not a folder"),
    (["--resume", "MISSING"], "no checkpoint in"),
])
def test_a_bad_command_line_is_one_message_before_any_rank_starts(tmp_path, spec, needle):
    binary = tmp_path / "weights.dat"  # (.bin is a pre-tokenized token file)
    binary.write_bytes(bytes(range(256)) * 64)
    (tmp_path / "FILE").write_text("not a folder")
    spec = [str(binary) if v == "BINARY" else str(tmp_path / "missing") if v == "MISSING" else
            str(tmp_path / v) if v.startswith("FILE") else v for v in spec]
    out = tmp_path / "out"
    r = _cli(tmp_path, "--nproc", "8", "--out", str(out), *spec) if "--out" not in spec else \
        _cli(tmp_path, "--nproc", "8", *spec)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    assert not out.exists()  # no rank ran: nothing was prepared


def test_out_without_room_for_two_checkpoints_is_refused(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from gridweave.cli import parse_train

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - 4096, 4096))
    with pytest.raises(OSError, match=r"4096 bytes|0 MiB free on its disk, this run needs about") as e:
        parse_train([*ARGS, "--out", str(tmp_path / "run")]).check_files()
    assert e.value.errno == errno.ENOSPC


def test_divergence_stops_the_run_and_writes_no_non_finite_checkpoint(tmp_path):
    """--lr 1e6: the gradient norm is NaN from the second step; those steps update nothing,
    --max-bad-steps of them in a row stop the run with one message and a non-zero exit. The
    checkpoints before it are finite and load."""
    out = tmp_path / "run"
    r = _cli(tmp_path, "--nproc", "2", "--out", str(out), "--lr", "1e6", "--steps", "12", "--checkpoint-every", "1",
             "--sync-save", "--max-bad-steps", "3")
    assert r.returncode != 0, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Diverged: training diverged: 3 steps in a row" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    index = gw.train.load_checkpoint(out)
    assert 1 <= index["step"] < 12
    state = gw.checkpoint.export_dense(out / "checkpoint")
    assert all(bool(torch.isfinite(t).all()) for t in state.values())
    assert all(math.isfinite(v) for v in index["losses"][:index["step"]])


def test_a_corrupted_weight_is_never_checkpointed(tmp_path):
    """Rank 1's first parameter turns NaN at step 3: the loss is NaN from then on (steps skipped,
    --max-bad-steps high), and the checkpoint of step 4 is refused on every rank; step 3's is
    the latest and finite."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [os.path.join(HERE, "faulty_train.py"), "1:3:nan", *ARGS, "--nproc", "0", "--steps", "8",
            "--checkpoint-every", "1", "--sync-save", "--max-bad-steps", "100", "--timeout", "30", "--out", str(out)]
    if os.environ.get(TRANSPORT_ENV) == "mpi":
        r = mpirun(2, [*args, "--backend", "mpi"], 200)
        errs = [r.stderr]
        codes = [r.returncode]
    else:
        procs = [subprocess.Popen([sys.executable, *args, "--backend", "gloo"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                                  env={**env, "RANK": str(k), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29703"}) for k in range(2)]
        codes = [p.wait(timeout=200) for p in procs]
        errs = [p.stderr.read() for p in procs]
    assert all(c != 0 for c in codes), errs
    assert all("not writing the checkpoint of step 4" in e for e in errs), [e[-1500:] for e in errs]
    assert gw.train.load_checkpoint(out)["step"] == 3
    assert all(bool(torch.isfinite(t).all()) for t in gw.checkpoint.export_dense(out / "checkpoint").values())


def _processes() -> dict:
    """pid -> (parent pid, command line, zombie) of every process but this one."""
    found = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{d}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            found[int(d)] = (int(ppid), cmd, state == "Z")
    return found


def _ranks_of(launcher: int, out: str) -> list:
    """The live ranks the launcher started: its Python descendants with the run's folder on their
    command line (mpirun's) or those forked by a fork server (torchrun's agent: launch.torchrun)."""
    procs = _processes()
    family, todo = set(), [launcher]
    while todo:
        parent = todo.pop()
        kids = [p for p, (pp, _, _) in procs.items() if pp == parent and p not in family]
        family.update(kids)
        todo += kids
    def exec_rank(cmd):  # a Python process of the run (not mpirun, whose command line names it too)
        return out in cmd and os.path.basename(cmd.split(" ", 1)[0]).startswith("python")

    return [p for p in family if not procs[p][2] and (exec_rank(procs[p][1]) or "multiprocessing.forkserver" in
                                                     procs.get(procs[p][0], (0, "", False))[1])]


def _kill_all(launcher: subprocess.Popen, out) -> None:
    """SIGKILL the launcher's group and every live rank of the run (they are in sessions of their own)."""
    ranks = _ranks_of(launcher.pid, str(out)) if launcher.poll() is None else []
    for pid in ranks + [p for p, (_, cmd, zombie) in _processes().items() if str(out) in cmd and not zombie]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait(timeout=30)


def _alive(pids) -> list:
    procs = _processes()
    return [p for p in pids if p in procs and not procs[p][2]]


def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    """kill -9 on the launcher's process group (the ranks are in sessions of their own): every
    rank gets SIGTERM from the kernel (parent-death signal) and nothing writes to --out."""
    out = tmp_path / "orphans"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": "29705"}
    env.pop("RANK", None)
    p = subprocess.Popen([sys.executable, "-m", "gridweave.cli", "train", *ARGS, *launcher_args(), "--nproc", "2",
                          "--steps", "100000", "--out", str(out)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "tokens.json").exists():  # the ranks are training
            time.sleep(0.5)
        assert (out / "tokens.json").exists()
        # counted once they train: a child forked but not yet exec'd carries its parent's command line
        while time.monotonic() < deadline and len(ranks) != 2:
            ranks = _ranks_of(p.pid, str(out))
            time.sleep(0.5)
        assert len(ranks) == 2, ranks
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(ranks):
            time.sleep(0.5)
        assert not _alive(ranks)
    finally:  # a failed assertion leaves no job training on (it would hold its port and the cores)
        _kill_all(p, out)


def _failed_write(ctx, folder):
    """Step 1 saves; at step 2 rank 1's write fails as on a full disk (its temporary file
    half-written): every rank raises, naming the path; step 1 stays the latest."""
    from gridweave import checkpoint

    grid = ctx.init(dp=2, timeout=30.0)
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float64, device="cpu") + 10 * ctx.rank)
    items = [(f"w{ctx.rank}", p, (6,))]

    def tensors_of(q):
        return {"param": q}

    checkpoint.save(folder, 1, items, grid, tensors_of, {"note": "first"})
    real = checkpoint._write_rank

    def full_disk(step_dir, rank, shards, meta):
        if rank == 1:
            def write(tmp):
                tmp.write_bytes(b"half")
                raise OSError(errno.ENOSPC, "No space left on device")
            checkpoint.atomic_write(step_dir / f"rank-{rank}.safetensors", write)
        return real(step_dir, rank, shards, meta)

    checkpoint._write_rank = full_disk
    try:
        checkpoint.save(folder, 2, items, grid, tensors_of, {"note": "second"})
        return "no error"
    except OSError as e:
        return type(e).__name__, str(e)
    finally:
        checkpoint._write_rank = real
        gw.shutdown()


def test_a_failed_write_fails_the_save_everywhere_and_keeps_the_previous_step(pool, tmp_path):
    res = pool.run(_failed_write, 2, str(tmp_path / "ckpt"), timeout=90)
    assert res[1][0] == "WriteError" and "the disk is full" in res[1][1], res
    assert "rank-1.safetensors" in res[1][1], res[1]
    assert res[0][0] == "WriteError" and "another rank could not write its shard" in res[0][1], res[0]
    step_dir, index = gw.checkpoint.open_index(tmp_path / "ckpt")
    assert index["note"] == "first" and index["step"] == 1
    leftovers = [f for f in (tmp_path / "ckpt").rglob("*") if gw.checkpoint.TMP_MARK in f.name]
    assert leftovers == []


def _slow_maker(ctx, case):
    """gw.train.made_while_beating on 4 ranks whose grid timeout is 1 s: makers ranks 0 and 2 (the
    node-local data cache's first ranks), rank 2 taking 3 s."""
    from gridweave.train import made_while_beating

    grid = ctx.init(dp=4, timeout=1.0)

    def make():
        if case == "fails" and ctx.rank == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        time.sleep(3.0 if ctx.rank == 2 else 0.1)

    try:
        made_while_beating(grid, ctx.rank in (0, 2), make, 1.5 if case == "late" else 60.0, "the data in F")
    except (gw.GridError, OSError) as e:
        return type(e).__name__, str(e)
    t = torch.ones(2, device="cpu")  # the grid still works: every rank left together
    grid.all_reduce(t, axis="dp")
    return "made", t.tolist()


@pytest.mark.parametrize("case", ["slow", "late", "fails"])
def test_the_ranks_wait_for_a_data_maker_by_data_timeout_not_the_grid_timeout(pool, case):
    """A maker 3 times slower than the grid's timeout: the others wait for it (no CommTimeout); past
    data_timeout every rank stops with one error; a maker's failure is every rank's error."""
    res = pool.run(_slow_maker, 4, case, timeout=60)
    if case == "slow":
        assert res == [("made", [4.0, 4.0])] * 4, res
    elif case == "late":
        assert all(r[0] == "GridError" and "the data in F was not prepared within data_timeout=1.5 s" in r[1]
                   for r in res), res
    else:
        assert res[2][0] == "OSError" and "No space left" in res[2][1], res
        assert all(res[k] == ("GridError", "the data in F could not be prepared (the rank that made it says why)")
                   for k in (0, 1, 3)), res


def test_atomic_write_names_the_path_and_the_limit(tmp_path):
    """A write past the process's file size limit (ulimit -f, the stand-in for a full disk
    here): WriteError naming the file and the limit; no temporary file stays."""
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "from gridweave.checkpoint import atomic_write, WriteError\n"
        "try:\n"
        "    atomic_write(sys.argv[1], lambda t: t.write_bytes(bytes(1 << 16)))\n"
        "except WriteError as e:\n"
        "    print(e.strerror)\n")
    target = tmp_path / "big.bin"
    r = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True, text=True, timeout=60)
    assert f"cannot write {target}" in r.stdout and "ulimit -f" in r.stdout, (r.stdout, r.stderr)
    assert list(tmp_path.iterdir()) == []


def test_temporaries_of_an_interrupted_save_are_removed(tmp_path):
    step = tmp_path / "step-00000002"
    step.mkdir()
    (step / "rank-3.safetensors.tmp4242").write_bytes(b"half")
    (step / "rank-3.json").write_text("{}")
    gone = gw.checkpoint.remove_stale_temporaries(tmp_path)
    assert [f.name for f in gone] == ["rank-3.safetensors.tmp4242"]
    assert [f.name for f in step.iterdir()] == ["rank-3.json"]


def test_fp16_leaves_non_finite_steps_to_the_loss_scaler_until_its_floor(tmp_path):
    """A NaN weight at step 2 under fp16: every step's loss is NaN. The loss scaler skips and
    backs off (2^16 down to 1: 16 steps), only then do bad steps count; 3 of them stop the run."""
    import re

    out = tmp_path / "run"
    args = [os.path.join(HERE, "faulty_train.py"), "0:2:nan", *ARGS, "--nproc", "0", "--steps", "40",
            "--precision", "fp16", "--timeout", "30", "--out", str(out), "--sample-tokens", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29707"}
    r = subprocess.run([sys.executable, *args, "--backend", "gloo"], capture_output=True, text=True, timeout=300,
                       env=env, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    m = re.search(r"3 steps in a row \(steps (\d+)-(\d+)\)", r.stderr)
    assert m, r.stderr[-2000:]
    assert (int(m.group(1)), int(m.group(2))) == (19, 21)  # steps 3-18 (1-based) were the scaler's 16 skips


@pytest.mark.parametrize("argv, needle", [
    (["train", "--dpp", "2"], "unrecognized argument --dpp; did you mean --dp?"),
    (["train", "--steps", "many"], "invalid int value"),
    (["frobnicate"], "invalid choice"),
    (["generate", "--run", "{tmp}/nowhere", "--prompt", "hi"], "nowhere"),
    (["generate", "--run", "{tmp}/nowhere", "--prompt", "hi", "--temperature", "-1"], "temperature must be"),
    (["generate", "--run", "{tmp}/nowhere", "--prompt", "hi", "--top-k", "-3"], "--top-k must be >= 0"),
    (["export", "--run", "{tmp}/nowhere", "--out", "{tmp}/hf"], "nowhere"),
    (["plan", "--gpus", "8", "--batch", "8", "--heads", "5"], "heads"),
    (["bench", "--calibrate", "--nproc", "0"], "--nproc must be a positive integer"),
])
def test_every_subcommand_answers_bad_input_with_one_line(tmp_path, argv, needle):
    """Bad input to any gridweave subcommand: one line on stderr, exit 2, no traceback, nothing written."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", *argv], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and not any(tmp_path.iterdir())


def test_a_rank_slowed_on_purpose_is_named_a_straggler(tmp_path):
    """Rank 2 of dp 4 made 50 ms slower in every forward (the tests' harness: a slow device): the
    straggler detector (Megatron-LM's, per pipeline stage: --straggler-threshold 0.5, windows of 3
    steps, named after 2 running) names rank 2 and no other rank, at the end of the second window
    and the third, in a line and in metrics.json, its forward and backward above its stage's median
    by more than the threshold while the others wait for it."""
    import json

    out = tmp_path / "run"
    loud = [a for a in ARGS if a != "--quiet"]
    args = [os.path.join(HERE, "faulty_train.py"), "2:0:slow", *loud, "--nproc", "0", "--steps", "9", "--dp", "4",
            "--val-every", "0", "--sample-tokens", "0", "--straggler-threshold", "0.5", "--straggler-every", "3",
            "--straggler-windows", "2", "--log", "jsonl", "--log-all-ranks", "--timeout", "60", "--out", str(out)]
    if os.environ.get(TRANSPORT_ENV) == "mpi":
        r = mpirun(4, [*args, "--backend", "mpi"], 300)
        codes, said = [r.returncode], r.stdout
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, *args, "--backend", "gloo"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                                  env={**env, "RANK": str(k), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29705"}) for k in range(4)]
        codes = [p.wait(timeout=300) for p in procs]
        said = procs[0].stdout.read()
    assert all(c == 0 for c in codes), (codes, said[-2000:])
    named = json.loads((out / "metrics.json").read_text())["stragglers"]
    assert [(s["rank"], s["step"]) for s in named] == [(2, 6), (2, 9)], named
    assert all(s["compute_s"] > 1.5 * s["median_s"] and s["coords"]["dp"] == 2 for s in named), named
    lines = [ln for ln in said.splitlines() if "straggler:" in ln]
    assert len(lines) == 2 and all("straggler: rank 2 (dp=2" in ln for ln in lines), said[-2000:]
    # every rank's logs: its compute and wait seconds each step; the slow rank computes longest, the others wait
    logged = {k: [json.loads(ln) for ln in (out / "logs" / (f"rank{k}" if k else "") / "log.jsonl").read_text().splitlines()
                  if '"step"' in ln] for k in range(4)}
    assert [(e["step"], sorted(e)) for e in logged[0] if "train/loss" not in e] == \
        [(6, ["step", "straggler/rank2/over_median"]), (9, ["step", "straggler/rank2/over_median"])], logged[0]
    steps = {k: [e for e in v if "train/loss" in e] for k, v in logged.items()}
    assert all(len(v) == 9 and all("perf/compute_s" in e and "perf/wait_s" in e for e in v) for v in steps.values())
    compute = {k: sum(e["perf/compute_s"] for e in v) for k, v in steps.items()}
    assert max(compute, key=compute.get) == 2, compute
    assert all(compute[2] - compute[k] > 9 * 0.05 * 0.9 for k in (0, 1, 3)), compute  # 50 ms a micro-batch's forward
    wait = {k: sum(e["perf/wait_s"] for e in v) for k, v in steps.items()}
    assert min(wait, key=wait.get) == 2, wait
