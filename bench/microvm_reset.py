"""What a microVM's reset costs, and the next user's first ``run_code`` after it.

    python bench/microvm_reset.py [--resets 10] [--keep-cache]

One microVM (the tier's defaults); each round reads the same stdlib files in its interpreter
(a user's work), resets (``Sandbox.reset()``, as a pool between users: a warm interpreter),
then runs one ``run_code`` importing a module (the next user's first call). A reset drops the
guest's page cache (its root helper's ``D``: one user's reads are not the next's to see);
``--keep-cache`` skips that drop, to measure it. Prints the medians and ranges, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

from stockade import Limits, Sandbox
from stockade.sandbox._microvm_instance import VMInstance
from stockade.sandbox.ops import Reset

WORK = "import email.mime.multipart, http.client, json, decimal; 1"
FIRST = "import json, csv; json.dumps(list(csv.reader(['a,b'])))"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resets", type=int, default=10)
    parser.add_argument("--keep-cache", action="store_true")
    args = parser.parse_args()
    resets, firsts, drops = [], [], []
    with Sandbox.create("microvm", limits=Limits(memory_mb=256, timeout_s=60)) as sbx:
        instance = sbx.instance
        assert isinstance(instance, VMInstance)
        drop = instance.vm.drop_caches

        def timed(timeout_s: float = 10.0) -> None:
            started = time.perf_counter()
            if not args.keep_cache:
                drop(timeout_s)
            drops.append((time.perf_counter() - started) * 1000)

        instance.vm.drop_caches = timed  # type: ignore[method-assign]
        sbx.run_code(WORK)
        for _ in range(args.resets):
            sbx.run_code(WORK)
            started = time.perf_counter()
            instance.execute(Reset(warm_interpreter=True))
            resets.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            sbx.run_code(FIRST)
            firsts.append((time.perf_counter() - started) * 1000)
    for name, values in (("reset", resets), ("of which the drop", drops), ("first run_code", firsts)):
        print(f"{name}: p50 {statistics.median(values):.0f} ms ({min(values):.0f}-{max(values):.0f})")


if __name__ == "__main__":
    main()
