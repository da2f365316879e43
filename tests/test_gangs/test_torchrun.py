import subprocess
import sys


def test_torchrun_launches_two_ranks():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "gangs", "--timeout-s", "20"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: root=0/2 ok  dp=0/2 ok  tp=0/1 ok" in proc.stdout
    assert "rank 1: root=1/2 ok  dp=1/2 ok" in proc.stdout


def test_bad_layout_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "gangs", "--tp-size", "3"], capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "world size 1 is not divisible by tp_size 3" in proc.stderr
