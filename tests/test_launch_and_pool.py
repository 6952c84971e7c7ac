"""shardzoo.launch and WorkerPool: results, failure and hang propagation, pool replacement."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import shardzoo
from shardzoo.comm.workers import RankTimeoutError, RemoteTraceback, WorkerDiedError, WorkerPool
from shardzoo.testing import get_pool, run_on_ranks


def rank_info(scale):
    return dist.get_rank() * scale, dist.get_world_size(), torch.get_num_threads(), os.getpid(), torch.rand(3)


def fail_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"bad value on purpose (rank {bad_rank})")
    return "fine"


def sleep_on_rank(bad_rank, seconds):
    if dist.get_rank() == bad_rank:
        time.sleep(seconds)
    return "done"


def wait_for_missing_rank(missing_rank):
    """Every rank but one enters an all_reduce: the others hang waiting for it."""
    if dist.get_rank() != missing_rank:
        dist.all_reduce(torch.ones(1))
    return "returned"


def die_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return "alive"


def all_fail():
    raise KeyError("every rank fails the same way")


def test_launch_returns_per_rank_results_shares_threads_and_seeds_ranks_alike():
    results = shardzoo.launch(rank_info, 2, 10, seed=7)
    assert [r[:2] for r in results] == [(0, 2), (10, 2)]
    cores = len(os.sched_getaffinity(0))
    assert all(r[2] == max(1, cores // 2) for r in results)
    expected = torch.rand(3, generator=torch.Generator().manual_seed(7))  # the default stream, seeded alike
    assert all(torch.equal(r[4], expected) for r in results)


def test_launch_reraises_first_failure_with_rank_and_remote_traceback():
    with pytest.raises(ValueError, match="bad value on purpose") as info:
        shardzoo.launch(fail_on_rank, 2, 1)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "traceback on rank 1" in str(info.value.__cause__)
    assert "fail_on_rank" in str(info.value.__cause__)
    if sys.version_info >= (3, 11):
        assert any("rank 1 of 2" in n for n in info.value.__notes__)


def test_launch_names_a_hung_rank_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        shardzoo.launch(sleep_on_rank, 2, 1, 60, timeout=4)
    assert info.value.ranks == [1]
    assert "rank(s) [1] did not finish sleep_on_rank within 4.0 s" in str(info.value)
    assert "sleep_on_rank" in str(info.value)  # its stack shows where it was stuck
    assert time.monotonic() - start < 30


def test_launch_names_the_rank_that_died():
    with pytest.raises(WorkerDiedError, match="rank 1 exited with code 3"):
        shardzoo.launch(die_on_rank, 2, 1)


def test_launch_rejects_unpicklable_function():
    with pytest.raises(TypeError, match="module-level function"):
        shardzoo.launch(lambda: 1, 1)


def test_pool_is_reused_between_calls():
    first = run_on_ranks(rank_info, 4, 1)
    second = run_on_ranks(rank_info, 4, 1)
    assert [r[3] for r in first] == [r[3] for r in second]


def test_pool_stays_usable_after_every_rank_raised():
    pool = get_pool(2)
    with pytest.raises(KeyError):
        pool.run(all_fail)
    assert pool.healthy and get_pool(2) is pool
    assert [r[0] for r in pool.run(rank_info, 1)] == [0, 1]


def test_hung_pool_is_replaced_not_reused():
    pool = WorkerPool(2, timeout=60)
    try:
        with pytest.raises(RankTimeoutError) as info:
            pool.run(wait_for_missing_rank, 1, timeout=3)
        assert info.value.ranks == [0]
        assert "all_reduce" in str(info.value)
        assert not pool.healthy
        with pytest.raises(RuntimeError, match="create a new one"):
            pool.run(rank_info, 1)
    finally:
        pool.close()


def test_partial_failure_closes_pool_after_grace():
    """Rank 1 raises while rank 0 waits for it in a collective: the error still comes back."""
    pool = WorkerPool(2, timeout=60, error_grace=1.0)
    try:
        with pytest.raises(ValueError, match="bad value"):
            pool.run(_fail_then_collective, 1)
        assert not pool.healthy
    finally:
        pool.close()


def _fail_then_collective(bad_rank):
    fail_on_rank(bad_rank)
    dist.all_reduce(torch.ones(1))


def test_same_script_runs_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys

            import torch.distributed as dist
            import shardzoo

            def main(x):
                mesh = shardzoo.ParallelMesh(tp=2)
                return x + dist.get_rank() + 10 * mesh.tp_rank

            if __name__ == "__main__":
                # one write per line: under torchrun both ranks share the output pipe
                sys.stdout.write(f"RESULTS {shardzoo.launch(main, 2, 100)}\\n")
            """
        )
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for cmd in ([sys.executable, str(script)], [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "RESULTS [100, 111]" in out.stdout, out.stdout


def test_short_function_timeout_cuts_neither_startup_nor_the_function_import(tmp_path, monkeypatch):
    """Spawning ranks takes seconds, and a worker imports the function's module when it unpickles
    it (seconds on a loaded host): a 0.5 s per-function timeout applies to neither, only to the
    function once every rank has it loaded."""
    import importlib

    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(1.5)\ndef two():\n    return 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("slow_to_import")
    with WorkerPool(2, timeout=0.5) as pool:
        assert [r[0] for r in pool.run(rank_info, 1)] == [0, 1]
        assert pool.run(module.two) == [2, 2]


def test_torchrun_rank_exits_promptly_after_an_error(tmp_path):
    """A rank started the torchrun way (init_from_env) that raises while its peer hangs exits at
    once: the atexit teardown does not wait on the peer for the collective timeout (60 s here),
    so the launcher sees the failure."""
    import socket

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(
        """
        import sys, time
        import torch.distributed as dist
        from shardzoo.comm.launch import init_from_env

        init_from_env("gloo", timeout=60)
        dist.barrier()
        if dist.get_rank() == 1:
            time.sleep(300)  # a hung peer
        sys.stdout.write("RAISING\\n")
        sys.stdout.flush()
        raise RuntimeError("rank 0 fails")
        """))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        line = procs[0].stdout.readline()
        assert line == "RAISING\n", line + procs[0].stderr.read()[-2000:]
        start = time.monotonic()
        code = procs[0].wait(timeout=50)
        assert time.monotonic() - start < 20 and code != 0
        assert "rank 0 fails" in procs[0].stderr.read()
    finally:
        for p in procs:
            p.kill()
            p.wait()
