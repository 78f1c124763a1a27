"""Where an acquire + release cycle spends its CPU, layer by layer, on one SQLite store.

Thread CPU time (``time.thread_time``) per cycle, so the durable sync's wait is left out and a
busy machine changes the figures little. Four ways of doing the same cycle on one id per
variant, measured round by round in one process on one store:

- ``claim()``: ``with own.claim(id): pass`` through ``Ownership`` (crash probe on, as the
  default; its thread's CPU is not counted);
- ``registry``: ``ClaimRegistry.acquire`` + ``release``;
- ``storage``: the two transactions the registry sends, by hand through the storage API: one
  ``read_then_write`` (holder and epoch read, three puts) and one ``conditional_batch`` (two
  conditions, two deletes), with the library's key and record encoders;
- ``raw``: the benchmark floor of ``bench/acquire_release.py`` (plain ``sqlite3``, the same
  rows).

Then the ``storage`` cycle again with parts of its write path switched off one after another
(an experiment on private attributes of this process's store, never a configuration): the
pre-commit identity check, the cross-process writer ``flock``, the batch validation. Each
line is the CPU left; the drop from the line above is what that part costs.

By default the store is on ``/dev/shm`` (no sync at all, so what is left is CPU);
``--dir`` puts it elsewhere.

    python bench/cycle_cpu.py [--dir /dev/shm] [--rounds 7] [--cycles 400]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acquire_release import RawSqliteContext, RegistryContext, _ids
from bench.common import StoreSpec, machine_note
from weft_sync import Ownership, OwnershipOptions, keys
from weft_sync.codec import HolderRecord, encode_epoch, encode_holder, mint_token
from weft_sync.storage import Condition, Delete, Put, Storage, open_storage
from weft_sync.storage.read_then_write import SupportsReadThenWrite
from weft_sync.storage.sqlite.identity import DIR_STAMP_MARGIN_NS
from weft_sync.storage.sqlite.store import SqliteStorage

Cycle = Callable[[], None]


def claim_cycle(ownership: Ownership, worker: int) -> Cycle:
    ids = itertools.cycle(_ids(worker))

    def cycle() -> None:
        with ownership.claim(next(ids)):
            pass

    return cycle


class CycleStore(Storage, SupportsReadThenWrite, Protocol):
    """A store the storage cycle runs on: SQLite's or PostgreSQL's."""


def storage_cycle(store: CycleStore, engine_id: str) -> Cycle:
    """The registry's two transactions by hand: a ``read_then_write`` acquire (holder and
    epoch read, the holder required absent, three puts) and a ``conditional_batch`` release."""
    ids = itertools.cycle([f"s-{n}" for n in range(8)])

    def cycle() -> None:
        wid = next(ids)
        epoch_key = keys.workflow_owner_epoch(wid)
        holder_key = keys.workflow_owner_holder(wid)
        entry_key = keys.workflow_owner_by_engine(engine_id, wid)
        written: dict[str, bytes] = {}

        def decide(values: list[bytes | None]) -> Any:
            held, stored = values
            if held is not None:
                return None
            epoch = 1 if stored is None else int.from_bytes(stored[:8], "big") + 1
            now = time.time_ns() // 1_000_000
            written["token"] = mint_token(epoch)
            written["holder"] = encode_holder(HolderRecord(engine_id, epoch, now + 30_000, now))
            conditions = [Condition(holder_key, None), Condition(epoch_key, stored)]
            puts = [
                Put(epoch_key, written["token"]),
                Put(holder_key, written["holder"]),
                Put(entry_key, encode_epoch(epoch)),
            ]
            return conditions, puts

        _, acquired = store.read_then_write([holder_key, epoch_key], decide)
        released = store.conditional_batch(
            [Condition(epoch_key, written["token"]), Condition(holder_key, written["holder"])],
            [Delete(holder_key), Delete(entry_key)],
        )
        if not (acquired and released):
            raise RuntimeError(f"the storage cycle of {wid} failed: {acquired=} {released=}")

    return cycle


def cpu_per_cycle(cycle: Cycle, rounds: int, cycles: int) -> float:
    """Median thread CPU per cycle, in microseconds."""
    samples = []
    for _ in range(rounds):
        began = time.thread_time()
        for _ in range(cycles):
            cycle()
        samples.append((time.thread_time() - began) / cycles * 1e6)
    return statistics.median(samples)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def hold(self) -> _Nothing:
        return self


def ablations(store: SqliteStorage) -> list[tuple[str, Callable[[], None]]]:
    """Parts of the write path to switch off, in order, each on top of the ones before."""
    import weft_sync.storage.sqlite.store as store_module
    import weft_sync.storage.sqlite.writer as writer_module

    def no_identity_check() -> None:
        assert store._writer is not None
        store._writer._before_commit = lambda: None

    def no_writer_flock() -> None:
        assert store._writer is not None
        setattr(store._writer, "_file_lock", _Nothing())  # noqa: B010

    def no_validation() -> None:
        def as_given(conditions: Any, operations: Any) -> Any:
            return list(conditions), list(operations)

        setattr(writer_module, "validate_batch", as_given)  # noqa: B010 (an experiment)
        setattr(store_module, "validate_batch", as_given)  # noqa: B010
        setattr(store_module, "validate_keys", list)  # noqa: B010

    return [
        ("- the pre-commit identity check (two stat calls per commit)", no_identity_check),
        ("- the cross-process writer flock (lock + unlock per commit)", no_writer_flock),
        ("- validating keys, conditions and operations", no_validation),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cycles", type=int, default=400)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="weft-cycle-cpu-", dir=args.dir)
    path = os.path.join(directory, "store.db")
    spec = StoreSpec("sqlite", f"sqlite:///{path}?table=kv", "kv", path=path)
    open_storage(spec.url).close()
    options = OwnershipOptions(claim_ttl="30s", claim_renew_interval="5s")
    ownership = Ownership.open(spec.url, options=options)
    registry = RegistryContext(spec)
    raw = RawSqliteContext(spec, shared=False)
    store = open_storage(spec.url)
    assert isinstance(store, SqliteStorage)
    variants = {
        "claim()": claim_cycle(ownership, 0),
        "registry": registry.cycle_for(1),
        "storage": storage_cycle(store, "engine-storage"),
        "raw": raw.cycle_for(2),
    }
    try:
        for cycle in variants.values():
            for _ in range(300):
                cycle()
        # The identity check rests on the directory's stamp once it is this old (see
        # weft_sync.storage.sqlite.identity), as in a settled host.
        time.sleep(DIR_STAMP_MARGIN_NS / 1e9 + 0.3)
        print(f"acquire + release CPU per cycle; {machine_note()}; store in {directory}")
        results: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, cycle in variants.items():
                results[name].append(cpu_per_cycle(cycle, 1, args.cycles))
        floor = statistics.median(results["raw"])
        print(f"{'variant':10s} {'CPU us/cycle':>13s} {'/ raw':>7s}")
        for name, samples in results.items():
            value = statistics.median(samples)
            print(f"{name:10s} {value:13.1f} {value / floor:6.2f}x")
        print("\nthe storage cycle with parts of its write path switched off:")
        left = cpu_per_cycle(variants["storage"], args.rounds, args.cycles)
        print(f"  {'everything on':62s} {left:6.1f} us")
        for label, switch_off in ablations(store):
            switch_off()
            now = cpu_per_cycle(variants["storage"], args.rounds, args.cycles)
            print(f"  {label:62s} {now:6.1f} us ({now - left:+.1f})")
            left = now
    finally:
        ownership.close()
        registry.close()
        raw.close()
        store.close()


if __name__ == "__main__":
    main()
