"""A rank of a 2-rank trainer group whose rank 1 hangs or dies: ``python -m harness.group_fail MODE OUT``.

Both ranks join (gloo, ``TIMEOUT_S``) and sum a gradient once; then rank 1 writes ``OUT.ready`` and, in mode
``hang``, sleeps instead of joining the next collective (in mode ``kill`` the test SIGKILLs it). Rank 0 keeps
summing gradients; the exception that ends it (the group's timeout, or the dead peer's closed connection) is
written to ``OUT`` as ``{"error": type name, "after_s": seconds from the last good collective}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

TIMEOUT_S = 5.0


def main() -> None:
    from livelora.trainer.distributed import TrainerGroup

    mode, out = sys.argv[1], Path(sys.argv[2])
    group = TrainerGroup.join(backend="gloo", timeout_s=TIMEOUT_S)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), float(group.rank + 1))
    group.all_reduce_grads([p])
    assert p.grad.tolist() == [3.0] * 4
    if group.rank == 1:
        Path(f"{out}.ready").write_text("")
        time.sleep(3600)  # hung (mode hang) or killed by the test (mode kill)
    while not Path(f"{out}.ready").exists():
        time.sleep(0.05)
    last = time.monotonic()
    try:
        for _ in range(10_000):
            group.all_reduce_grads([p])
            last = time.monotonic()
    except Exception as exc:
        out.write_text(json.dumps({"error": type(exc).__name__, "after_s": time.monotonic() - last, "mode": mode}))
        raise SystemExit(3) from None
    out.write_text(json.dumps({"error": None}))


if __name__ == "__main__":
    main()
