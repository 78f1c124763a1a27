"""Count the machine instructions one acquire + release cycle executes, layer by layer.

Wall and CPU times of a cycle swing by a third from run to run on a shared machine; the number
of instructions a cycle executes does not. For each variant of ``bench/cycle_cpu.py``
(``claim()``, ``registry``, ``storage``, ``raw``: the same cycles, on a SQLite store in
``/dev/shm``; ``claim()`` with ``background="manual"`` and no crash probe, since valgrind counts
every thread) this runs a child process twice under valgrind's ``callgrind`` tool, once with
``--warm`` cycles and once with ``--warm`` + ``--cycles``, and divides the difference of the two
totals by ``--cycles``: what is left is the cost of the cycles alone, start-up, imports and the
settling sleep excluded. Both children sleep until the store's directory stamp is trusted (see
``weft_sync.storage.sqlite.identity``) before their last cycles, as a settled host does.

The counts include SQLite's own work (the same for every variant that writes the same rows)
and everything Python runs; they leave out the wait for a sync. They measure work, not time: a
cycle whose instructions miss the CPU caches more costs more time than its count says. Needs
``valgrind`` (Debian: ``apt-get install valgrind``); about one minute per variant.

    python bench/cycle_instructions.py [--cycles 1000] [--warm 100] [--tree PATH]

``--tree`` runs the variants against another checkout of the library (its ``weft_sync`` first
on the path), to compare two trees in the same way.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if "--child" not in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("claim()", "registry", "storage", "raw")
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def _child(variant: str, count: int, directory: str) -> None:
    """Run ``count`` cycles of ``variant`` (in the child process, under valgrind)."""
    from bench.acquire_release import RawSqliteContext, RegistryContext
    from bench.common import StoreSpec
    from bench.cycle_cpu import claim_cycle, storage_cycle
    from weft_sync import Ownership, OwnershipOptions
    from weft_sync.storage import open_storage
    from weft_sync.storage.sqlite.identity import DIR_STAMP_MARGIN_NS
    from weft_sync.storage.sqlite.store import SqliteStorage

    path = os.path.join(directory, "store.db")
    spec = StoreSpec("sqlite", f"sqlite:///{path}?table=kv", "kv", path=path)
    open_storage(spec.url).close()
    closers: list[Callable[[], None]] = []
    cycle: Callable[[], None]
    if variant == "claim()":
        # No background thread: valgrind counts every thread's instructions.
        options = OwnershipOptions(
            claim_ttl="30s", claim_renew_interval="5s", crash_poll_interval=None
        )
        ownership = Ownership.open(spec.url, options=options, background="manual")
        closers.append(ownership.close)
        cycle = claim_cycle(ownership, 0)
    elif variant == "registry":
        context = RegistryContext(spec)
        closers.append(context.close)
        cycle = context.cycle_for(1)
    elif variant == "storage":
        store = open_storage(spec.url)
        assert isinstance(store, SqliteStorage)
        closers.append(store.close)
        cycle = storage_cycle(store, "engine-storage")
    else:
        raw = RawSqliteContext(spec, shared=False)
        closers.append(raw.close)
        cycle = raw.cycle_for(2)
    try:
        for _ in range(20):
            cycle()
        time.sleep(DIR_STAMP_MARGIN_NS / 1e9 + 0.3)
        for _ in itertools.repeat(None, count):
            cycle()
    finally:
        for close in closers:
            close()


def _instructions(variant: str, count: int, tree: Path, base: str) -> int:
    """Total instructions of a child running ``count`` cycles of ``variant``."""
    directory = tempfile.mkdtemp(prefix="weft-cycle-instr-", dir=base)
    try:
        # The child imports weft_sync and the benchmark helpers from the tree measured.
        env = dict(os.environ, PYTHONPATH=str(tree))
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--callgrind-out-file=/dev/null",
                sys.executable,
                __file__,
                "--child",
                variant,
                str(count),
                directory,
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run of {variant!r} failed ({done.returncode}):\n{done.stderr}")
    return int(found.group(1))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--warm", type=int, default=100)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    if args.cycles < 1 or args.warm < 0:
        parser.error(
            f"--cycles must be at least 1 and --warm at least 0, got {args.cycles}, {args.warm}"
        )
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    tree = args.tree.resolve()
    if not (tree / "weft_sync" / "__init__.py").is_file():
        parser.error(f"--tree {str(tree)!r} holds no weft_sync package")
    print(f"instructions per acquire + release cycle; tree {tree}; {args.cycles} cycles")
    per_cycle: dict[str, float] = {}
    for variant in VARIANTS:
        warm = _instructions(variant, args.warm, tree, args.dir)
        full = _instructions(variant, args.warm + args.cycles, tree, args.dir)
        per_cycle[variant] = (full - warm) / args.cycles
    floor = per_cycle["raw"]
    print(f"{'variant':10s} {'instructions':>13s} {'/ raw':>7s}")
    for variant, value in per_cycle.items():
        print(f"{variant:10s} {value:13,.0f} {value / floor:6.2f}x")


if __name__ == "__main__":
    main()
