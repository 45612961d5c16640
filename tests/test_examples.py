"""The examples and the sparse benchmark run end to end, in small sizes, and print their figures."""

import contextlib
import copy
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from parsum import _config, _host_exchange
from tests.test_distributed import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(script: str, *args: str, timeout: float = 100) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT / pathlib.Path(script).parent,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_slide_like():
    pytest.importorskip("sklearn")
    out = run(
        "examples/slide_like.py",
        "--hidden",
        "2048",
        "--active",
        "16",
        "--tables",
        "2",
        "--epochs",
        "1",
    )
    lines = [line for line in out.splitlines() if "test accuracy" in line]
    assert [line.split()[0] for line in lines] == ["sampled", "sampled", "dense"]
    accuracies = [float(line.split("accuracy")[1].split()[0]) for line in lines]
    assert all(0.1 < a <= 1.0 for a in accuracies)  # better than chance on 10 classes
    assert "faster per epoch" in out


def test_train_ensemble():
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    out = run("examples/train_ensemble.py", "--members", "2", "--epochs", "1")
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[2:4]}
    assert rows["plain"] == rows["parsum"]  # the same accuracy from the same weights
    assert "parsum speedup over the plain PyTorch loop" in out
    assert "parsum against the hand split" in out and "(the ceiling, no sum)" in out


def test_bench_sparse(tmp_path):
    out = run(
        "benchmarks/bench_sparse.py",
        "--rounds",
        "2",
        "--models",
        "2",
        "--max-log2",
        "9",
        "--json",
        str(tmp_path / "out.json"),
    )
    assert "growth from 256 to 512 rows" in out
    assert (tmp_path / "out.json").exists()


def test_distributed_ensemble_under_torchrun():
    pytest.importorskip("sklearn")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(ROOT / "examples/distributed_ensemble.py"),
            "--members",
            "4",
            "--epochs",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT / "examples",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # parsum.distributed.share gives rank 0 the widest member alone, rank 1 the other three.
    assert "2 processes, 4 members (1 on rank 0): test accuracy" in done.stdout


def test_bench_speedup_with_processes(tmp_path):
    pytest.importorskip("matplotlib")
    # A batch of its own (name:batch), as the README's runs name the medium workload's.
    args = ["--rounds", "2", "--jobs", "1,2", "--procs", "1,2", "--workloads", "large:64"]
    out = run(
        "benchmarks/bench_speedup.py",
        *args,
        "--json",
        str(tmp_path / "s.json"),
        "--png",
        str(tmp_path / "s.png"),
    )
    assert "procs 2" in out and "best processes" in out
    assert "4 MLPs, width 1024, 2 hidden layers, batch 64" in out
    assert "with an Adam step, against plain+adam: parsum+adam" in out
    assert (tmp_path / "s.png").stat().st_size > 0


def test_bench_speedup_replots_saved_results(tmp_path):
    pytest.importorskip("matplotlib")
    saved = ROOT / "benchmarks/results/speedup-2cores.json"
    out = run(
        "benchmarks/bench_speedup.py", "--replot", str(saved), "--png", str(tmp_path / "p.png")
    )
    assert "wrote" in out and (tmp_path / "p.png").stat().st_size > 0
    assert "heterogeneous-medium: 16 MLPs" in out and "parsum default against: faster plain" in out


def test_bench_steps():
    out = run(
        "benchmarks/bench_steps.py", "--rounds", "1", "--workloads", "heterogeneous-medium:16"
    )
    for method in ("plain+adam", "parsum+adam", "ParallelSum+adam", "sib", "sib loop"):
        assert f"{method:>18} " in out
    assert "plain+adam / this" in out


def test_bench_chunks(tmp_path):
    args = ["--rounds", "1", "--jobs", "1,2", "--workloads", "mixed-sizes"]
    out = run("benchmarks/bench_chunks.py", *args, "--json", str(tmp_path / "chunks.json"))
    assert "costliest chunk / (total / 16), estimated: cost chunks" in out
    assert (tmp_path / "chunks.json").exists()


def test_bench_overhead(tmp_path):
    out = run("benchmarks/bench_overhead.py", "--rounds", "1", "--zero-grad")
    assert "grads set to None before each step" in out
    assert "parsum autograd" in out and "of the step" in out


def test_bench_overhead_graph_floor_trains_as_the_plain_loop(monkeypatch):
    """The floor a benchmark row compares parsum with does the same work: gradients of the
    plain loop's loss into every parameter's ``.grad``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_overhead
    from common import loss_of, workload

    w = workload("distinct-tiny", 8)
    models, twins = w.models[:5], copy.deepcopy(w.models[:5])
    bench_overhead.graph_floor(models, w.x)()
    loss_of(sum(m(w.x) for m in twins)).backward()
    for m, twin in zip(models, twins):
        for p, q in zip(m.parameters(), twin.parameters()):
            assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6)


class _NoStream:
    """A CUDA stream's calls, doing nothing: the stream methods' control flow on the CPU."""

    def wait_stream(self, other: object) -> None:
        assert isinstance(other, _NoStream)


def test_bench_streams_methods_train_as_the_plain_loop(monkeypatch):
    """The stream ceilings of bench_streams.py (written for a GPU) compute the plain loop's
    gradients, with CUDA's stream calls stood in by ones that do nothing; the script itself
    runs its CPU methods."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_streams
    from common import loss_of, workload

    monkeypatch.setattr(torch.cuda, "Stream", _NoStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _NoStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None, raising=False)
    w = workload("heterogeneous-medium", 8)
    twins = copy.deepcopy(w.models)
    loss_of(sum(m(w.x) for m in twins)).backward()
    for step in (
        bench_streams.streams_step(w.models, w.x, 3),
        lambda: bench_streams.two_phase_step(
            bench_streams.StreamedTwoPhase(w.models, 2, w.x), w.models, w.x
        ),
        lambda: bench_streams.threaded_forwards_step(
            bench_streams.TwoPhase(w.models, 2, w.x), w.models, w.x
        ),
    ):
        step()
        for m, twin in zip(w.models, twins):
            for p, q in zip(m.parameters(), twin.parameters()):
                assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6)
    monkeypatch.undo()
    out = run(
        "benchmarks/bench_streams.py",
        "--rounds",
        "1",
        "--device",
        "cpu",
        "--threads",
        "2",
        "--workloads",
        "heterogeneous-tiny:8",
    )
    assert "threads 2" in out and "forwards 2" in out and "parsum 2" in out
    assert "fastest: " in out


@pytest.mark.timeout(360)
def test_bench_allocator(tmp_path):
    args = ["--processes", "1", "--steps", "3", "--batch", "8"]
    # 33 s alone on a 2-vCPU machine, over 100 s beside another pytest worker's heavy tests
    out = run(
        "benchmarks/bench_allocator.py", *args, "--json", str(tmp_path / "alloc.json"), timeout=300
    )
    assert out.count("parsum against the plain loop alone") == 2 and "thresholds fixed" in out
    assert (tmp_path / "alloc.json").exists()


def test_bench_phases():
    args = ["--rounds", "1", "--jobs", "2", "--workloads", "heterogeneous-tiny"]
    out = run("benchmarks/bench_phases.py", *args)
    assert "two-phase" in out and "x the two-phase ceiling's speed" in out
    assert "caller cpu" in out and "others cpu" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("2 ")]
    assert [row[1] for row in rows] == ["hand", "two-phase", "parsum"]
    for row in rows:
        step, caller, others = map(float, row[-3:])
        assert step > 0 and caller >= 0 and others >= 0
        if _tells_thread_cpu():  # where the system tells the CPU times
            assert caller > 0  # every method's step runs in the calling thread
            assert caller + others > 0.1 * step  # a step computes: its threads ran


def _tells_thread_cpu() -> bool:
    """Whether Linux tells each thread's CPU time here (``common.thread_cpu_ns``'s source)."""
    return pathlib.Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").is_file()


def test_thread_cpu_ns_tells_which_thread_worked(monkeypatch):
    """A thread that spins 50 ms runs about 50 ms of CPU; the caller, waiting, runs little."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import common

    if not _tells_thread_cpu():
        assert common.thread_cpu_ns() == {}
        return

    spun, read = threading.Event(), threading.Event()

    def spin():
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
        spun.set()
        read.wait(timeout=60)  # alive until read: an ended thread is not listed

    before = common.thread_cpu_ns()
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert spun.wait(timeout=60)
        caller, others = common.cpu_split(before, common.thread_cpu_ns())
    finally:
        read.set()
        thread.join()
    assert others > 0.01 and caller < others


def test_bench_team():
    args = ["--rounds", "1", "--settle-ms", "0", "--workloads", "heterogeneous-medium:16"]
    out = run("benchmarks/bench_team.py", *args, "--jobs", "default,2")
    assert "parsum+adam 2w kept" in out and "parsum+adam 2w: team ended / kept" in out
    assert "the caller's team can be ended: " in out


def command_lines_with(text: str) -> list[str]:
    """The command lines of this machine's processes that hold ``text``, read from /proc where
    there is one (``pgrep`` is missing from slim images: Debian's minbase has no procps)."""
    if not pathlib.Path("/proc").is_dir():
        listed = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True)
        return listed.stdout.split()
    found = []
    for path in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended since the listing
            continue
        if text in line:
            found.append(line)
    return found


def test_bench_loaded():
    args = ["--rounds", "1", "--settle-ms", "0", "--nice", "idle,10", "--adam"]
    out = run("benchmarks/bench_loaded.py", *args, "--workloads", "heterogeneous-medium:16")
    assert "Adam after each step" in out and "1 busy at nice 10, ms" in out
    ratios = [line.split()[4:] for line in out.splitlines() if "faster plain / this" in line]
    assert len(ratios) == 2 and all(len(row) == 6 for row in ratios)
    assert max(float(r) for r in ratios[0][:2]) == 1.0  # the faster plain loop against itself
    # Its spinning processes end with it.
    assert not command_lines_with("while True: pass")
    args = ["--loop", "3", "--nice", "idle", "--workloads", "heterogeneous-medium:8"]
    out = run("benchmarks/bench_loaded.py", *args)
    assert "loops of 3 steps, each in a process of its own" in out
    (times,) = [line.split()[2:] for line in out.splitlines() if "idle, ms" in line]
    assert len(times) == 6 and all(float(t) > 0 for t in times)


def test_bench_intra_op():
    for adam in ([], ["--adam"]):
        args = ["--rounds", "1", "--workloads", "distinct-tiny:8", *adam]
        out = run("benchmarks/bench_intra_op.py", *args)
        assert "default against one chunk " in out and "against the faster plain loop: " in out
    assert "; steps with Adam" in out


def test_bench_against_another_revision():
    args = ["--rev", "HEAD", "--rounds", "1", "--settle-ms", "0", "--adam"]
    out = run("benchmarks/bench_against.py", *args, "--workloads", "heterogeneous-medium:16")
    assert "this checkout against HEAD" in out and "this / HEAD " in out


def test_bench_against_a_folder_holding_a_parsum(tmp_path):
    # A lent machine's copy of the tree has no git history: the code before in a folder.
    shutil.copytree(ROOT / "parsum", tmp_path / "parsum")
    args = ["--rev", str(tmp_path), "--rounds", "1", "--settle-ms", "0"]
    out = run("benchmarks/bench_against.py", *args, "--workloads", "heterogeneous-medium:16")
    assert f"this checkout against {tmp_path}" in out and f"this / {tmp_path} " in out


def test_bench_against_several_revisions(tmp_path):
    shutil.copytree(ROOT / "parsum", tmp_path / "parsum")
    args = ["--rev", f"HEAD,{tmp_path}", "--rounds", "1", "--settle-ms", "0"]
    out = run("benchmarks/bench_against.py", *args, "--workloads", "distinct-tiny:8")
    last = out.splitlines()[-1]
    assert f"{tmp_path} " in last and "this / HEAD " in last and f"this / {tmp_path} " in last


def test_bisect_revisions(tmp_path):
    # Two revisions that changed parsum: the coarse pass takes both, the fine pass the same two.
    archive = tmp_path / "revs.tar.xz"
    done = subprocess.run(
        ["git", "log", "--format=%h", "-n", "2", "--", "parsum"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or len(done.stdout.split()) < 2:
        pytest.skip("needs this checkout's git history")
    later, first = done.stdout.split()
    out = run("benchmarks/bisect_revs.py", "prepare", f"{first}..{later}", str(archive))
    assert "2 revisions of parsum" in out
    args = ["--coarse", "5", "--rounds", "1", "--settle-ms", "0"]
    out = run(
        "benchmarks/bisect_revs.py", "run", str(archive), *args, "--workloads", "distinct-tiny:8"
    )
    assert "coarse pass: 2 revisions" in out and "fine pass: 000-" in out
    assert f"change point: 000-{first} | 001-{later}, the steps after it " in out, out
    args = ["--cores", "4", "--steps", "2", "--workloads", "distinct-tiny:8"]
    out = run("benchmarks/bisect_revs.py", "decisions", str(archive), *args)
    assert "2 revisions, 4 cores faked; the jobs of step 2 " in out
    assert f"000-{first}, 64 distinct MLP classes" in out and "run_ordered(" in out, out


@pytest.mark.parametrize("step", ["flat", "flat-zero"])
def test_bench_against_with_a_flat_grad(step):
    args = ["--rev", "HEAD", "--rounds", "1", "--settle-ms", "0", "--step", step]
    out = run("benchmarks/bench_against.py", *args, "--workloads", "distinct-tiny:8")
    assert "this / HEAD " in out.splitlines()[-1]


def test_bench_pace():
    out = run("benchmarks/bench_pace.py", "--rev", "HEAD", "--calls", "400")
    rows = [line.split() for line in out.splitlines() if line.rstrip().endswith("%")]
    assert len(rows) == 7 and "this" in out
    busy = next(r for r in rows if "busy" in r)
    assert float(busy[-1].rstrip("%")) > 50  # a busy machine still goes alone


def test_bench_against_by_cpu_time(monkeypatch):
    """``--cpu-time`` times the CPU time of the process's threads: a step that sleeps reads
    almost none, one that computes as long reads its time."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from common import interleaved

    def busy() -> None:
        end = time.perf_counter() + 0.01
        while time.perf_counter() < end:
            pass

    methods = {"sleeps": lambda: time.sleep(0.01), "computes": busy}
    cpu = interleaved(methods, 3, warmup=0, clock=time.process_time)
    assert cpu["sleeps"] < 0.3 * cpu["computes"], cpu
    wall = interleaved(methods, 3, warmup=0)
    assert wall["sleeps"] > 0.5 * wall["computes"], wall
    args = ["--rev", "none", "--rounds", "1", "--settle-ms", "0", "--cpu-time"]
    out = run("benchmarks/bench_against.py", *args, "--workloads", "distinct-tiny:8")
    assert "CPU time of all threads" in out and "this " in out.splitlines()[-1]


def test_bench_against_with_members_drawn_at_random():
    args = ["--rev", "none", "--rounds", "2", "--settle-ms", "0", "--members", "0.5"]
    out = run("benchmarks/bench_against.py", *args, "--workloads", "distinct-tiny:8")
    assert "0.5 of the models drawn a step" in out and "this " in out.splitlines()[-1]


def test_profile_step_of_members_drawn_at_random():
    args = ["--workload", "distinct-tiny", "--batch", "8", "--steps", "2", "--members", "0.5"]
    out = run("benchmarks/profile_step.py", *args, "--profile", "parsum default")
    assert "0.5 of them drawn a step" in out
    assert "cProfile, parsum default, 2 steps, by tottime:" in out
    assert "cProfile, parsum default, 2 steps, by cumulative:" in out
    assert "_general_sum" in out  # each step plans a new set


def test_bench_forward_workers():
    args = ["--workloads", "heterogeneous-medium:16", "--caps", "1,2", "--hand", "2"]
    out = run("benchmarks/bench_forward_workers.py", *args, "--rounds", "1")
    rows = {line[:18].strip(): line.split() for line in out.splitlines()[2:]}
    assert list(rows) == [
        "plain", "plain-1t", "parsum default", "default fwd<=1", "default fwd<=2",
        "hand-split 2",
    ]  # fmt: skip
    assert all(float(row[-8]) > 0 for row in rows.values())  # ms a step
    assert rows["hand-split 2"][-1] == "1.00"


def test_bench_pullback_workers():
    args = ["--workloads", "distinct-tiny:8", "--caps", "2", "--rounds", "1"]
    out = run("benchmarks/bench_pullback_workers.py", *args)
    rows = {line[:14].strip(): line.split() for line in out.splitlines()[2:]}
    assert list(rows) == ["plain", "plain-1t", "pullbacks<=1", "pullbacks<=2"]
    assert all(float(row[1]) > 0 for row in rows.values())  # ms a step
    assert "x the calling thread alone [" in " ".join(rows["pullbacks<=2"])


def test_bench_stacking():
    out = run("benchmarks/bench_stacking.py", "--quick", "--threads", "1", "--rounds", "1")
    assert "64x width 32 depth 2 batch 32 (0.06M param-rows), 1 threads: plain" in out
    assert "stack_ stacked" in out and "| fastest: " in out


def test_bench_exchange():
    out = run(
        "benchmarks/bench_exchange.py", "--procs", "2", "--steps", "20", "--compute-ms", "0.5"
    )
    rows = [line.split() for line in out.splitlines()[2:]]
    modes = [" ".join(row[1:-5]) for row in rows]
    shared = ["shared memory"] if _host_exchange.supported() else []
    assert modes == ["compute only", "gloo", "gloo pinned", *shared]
    for row in rows:
        step, *exchange = map(float, row[-5:-1])
        assert step > 0 and all(t >= 0 for t in exchange) and row[-1].endswith("%")


def test_bench_process_engine():
    """The process engine's prototype computes the plain loop's gradients (checked in the
    script before it times anything) and prints every method's step and its ratios."""
    args = ["--rounds", "1", "--caller-share", "0.55", "--workloads", "distinct-tiny:8"]
    out = run("benchmarks/bench_process_engine.py", *args, timeout=300)
    (header,) = [line for line in out.splitlines() if "gradients against the plain loop" in line]
    assert header.startswith("64 distinct MLP classes, widths 16-47, batch 8; P = 2")
    assert float(header.rsplit(":", 1)[1]) <= 1e-6
    rows = {" ".join(row[:-1]): float(row[-1]) for row in map(str.split, out.splitlines()[4:12])}
    methods = ["plain", "plain 1", "parsum", "hand split", "two-phase", "process engine"]
    assert list(rows) == [*methods, "caller 0.55", "procs"]
    assert all(ms > 0 for ms in rows.values())
    for engine in ("process engine", "caller 0.55"):
        assert f"  {engine}: " in out and "x the torchrun-like processes'" in out


def test_bench_join():
    args = ["--rounds", "1", "--jobs", "2", "--any-size", "--workloads", "heterogeneous-tiny:8"]
    out = run("benchmarks/bench_join.py", *args)
    assert "64 MLPs, widths 16-48, batch 8" in out
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("2 ")]
    later, node, ratio = float(row[1]), float(row[3]), float(row[5].rstrip("x"))
    # The times are printed to 0.01 ms and the ratio to 0.001: the ratio of the printed times
    # may differ by their rounding (3.089 against 3.087 from 21.62 / 7.00 under load).
    rounding = ratio * (0.005 / later + 0.005 / node) + 0.0005
    assert later > 0 and node > 0 and ratio == pytest.approx(node / later, abs=rounding)


def test_bench_cold():
    out = run("benchmarks/bench_cold.py", "--repeats", "2", "--ms", "0.1")
    rows = [line for line in out.splitlines() if "x back to back" in line]
    assert len(rows) == 10 and all(line.startswith(("1 ", "2 ")) for line in rows)
    assert "after 0.1 ms of sleep" in out and "after a 1024 x 1024 matmul" in out
    assert all(float(line.split()[-6]) > 0 for line in rows)


@pytest.mark.skipif(
    _config.usable_cores() < 2, reason="its process has one usable core: no job to place"
)
def test_bench_places():
    args = ["--steps", "2", "--jobs", "2", "--workloads", "heterogeneous-tiny:8"]
    out = run("benchmarks/bench_places.py", *args)
    assert "64 MLPs, widths 16-48, batch 8" in out
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("2 ")]
    step, serial, before, between, after = map(float, row[1:6])
    assert 0 < serial < step and serial == pytest.approx(before + between + after, abs=0.02)
    for job in (row[7:11], row[12:16]):
        wall, ideal, slowdown, _idle = map(float, job)
        assert wall > 0 and ideal > 0 and slowdown > 0
