"""`lmppo train` in one process of a torchrun job (tests/test_deepspeed_resume.py, benchmarks/tools/fault_injection.py).

    torchrun --standalone --nproc_per_node N tests/zero_worker.py train CONFIG.yaml
    torchrun --standalone --nproc_per_node N tests/zero_worker.py train --resume RUN

With $STALL_IN_WRITE = "RANK:ITERATION", process RANK stops inside the checkpoint write of iteration ITERATION,
after DeepSpeed has written its shards and before the processes meet at the barrier that lets process 0 publish
the checkpoint: it writes its pid to the file $STALL_MARKER and sleeps, for the test to SIGKILL it there.
"""

from __future__ import annotations

import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def stall_in_write(rank: int, iteration: int, marker: str) -> None:
    import lmppo.distributed.zero as distributed

    original = distributed.ZeroSupport.save_engine

    def save_engine(self, engine, folder):
        original(self, engine, folder)
        written = re.search(r"iter-(\d+)", os.path.basename(folder))
        if self.accelerator.process_index == rank and written and int(written.group(1)) == iteration:
            with open(marker + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(marker + ".tmp", marker)
            while True:
                time.sleep(60)

    distributed.ZeroSupport.save_engine = save_engine


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    stall = os.environ.get("STALL_IN_WRITE")
    if stall:
        rank, iteration = (int(x) for x in stall.split(":"))
        stall_in_write(rank, iteration, os.environ["STALL_MARKER"])
    from lmppo.apps.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
