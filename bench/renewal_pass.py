"""Renewal pass: renew_many against a per-claim renew loop and a hand-written raw floor.

For 1k / 10k / 100k held claims (``--quick``: 1k / 10k) on SQLite and PostgreSQL, each measured in
the same run, repeats interleaved:

- ``renew_many``: ``registry.renew_many(ids)`` (chunks of 2,000 claims, one transaction each);
- ``renew_many, one txn``: the same with one chunk holding every claim;
- ``subpass``: ``run_renewal_subpass(create_renewal_target(registry), ids)``, what the renewal
  task runs (chunks of 1,000 ids spread over a 16-thread pool);
- ``renew loop``: ``registry.renew(id)`` for each claim; measured on all ids up to 5,000 (1,000
  with ``--quick``) and extrapolated linearly beyond that (the table says so);
- raw floors: the same byte-exact compare-and-update written by hand against the driver, on a
  twin table seeded with the same bytes, in ONE transaction. SQLite: ``BEGIN IMMEDIATE`` and per
  key ``SELECT`` + compare + ``UPDATE`` (``raw select+update``), per key ``UPDATE … WHERE key=?
  AND value=?`` with a rowcount check (``raw update-where``), or one ``executemany`` of that
  UPDATE whose total rowcount proves every claim renewed (``raw executemany``; per-claim outcomes
  only when all succeed). PostgreSQL: one ``UPDATE … FROM unnest(…) RETURNING key``
  (``raw unnest``). Every floor writes the bytes the library writes and builds them the way the
  library does: the packed ``expires_at`` is encoded once per pass and spliced between each
  holder's cached head and tail bytes (checked against ``encode_holder`` at seed time). One more
  variant, ``raw executemany, re-encoded``, packs every holder with ``msgpack.packb`` (what the
  floor did before it matched the library's byte handling); it is shown, never the floor. The
  lean floor is the fastest spliced raw variant of the run on a twin table that holds only the
  holder rows.
- same-layout floors: ``raw update-where`` and ``raw executemany`` again, on a second twin that is
  a copy of the library's whole table in its storage order (SQLite rowid, PostgreSQL ctid): the
  epoch, holder and by-engine entry rows of each claim side by side, as the library's acquires
  wrote them. The same CAS by hand on the same data and pages; the same-layout floor is the
  fastest of them. Both floors and both ratios are printed.

Targets (SQLite, 10k and 100k claims): renew_many within 1.5x of the floor, both with its default
chunks (``renew_many``) and in one transaction (``renew_many, one txn``), and at least 20x faster
than the per-claim loop, with per-claim outcomes. The verdict lines judge the 1.5x against each
floor.

    python bench/renewal_pass.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack

from bench.common import (
    ENGINE_ID,
    TTL_MS,
    Samples,
    Site,
    StoreSpec,
    bench_site,
    hold_claims,
    interleave,
    machine_note,
    ms,
    new_registry,
    parse_args,
    print_table,
    ratio,
    selected_backends,
    us,
    workflow_ids,
)
from weft_sync import keys
from weft_sync.claims.registry import DEFAULT_RENEW_CHUNK_SIZE
from weft_sync.claims.renewal_target import create_renewal_target
from weft_sync.clock import system_clock
from weft_sync.codec import HolderRecord, encode_holder
from weft_sync.maintenance.subpasses import run_renewal_subpass

FULL_SIZES = (1_000, 10_000, 100_000)
QUICK_SIZES = (1_000, 10_000)
TARGET_SIZE = 10_000
TARGET_SIZES = (10_000, 100_000)
FLOOR_TARGET = 1.5
SAME = ", same layout"
LOOP_TARGET = 20.0


class RawHolders:
    """A twin table renewed by hand; remembers the holder bytes it last wrote.

    ``same_layout=False`` (the lean floor): the twin holds only the holder rows.
    ``same_layout=True``: the twin is a copy of the library's whole table (epoch, holder and
    by-engine entry rows, in the library's row order), so the hand-written CAS runs on the same
    data and pages as the library's.
    """

    def __init__(
        self, spec: StoreSpec, ids: list[str], claimed_at: int, *, same_layout: bool = False
    ) -> None:
        self.spec = spec
        self.table = ("same_" if same_layout else "raw_") + spec.table
        self.suffix = SAME if same_layout else ""
        self.keys = [keys.workflow_owner_holder(wid) for wid in ids]
        self.claimed_at = claimed_at
        first = self.encode(claimed_at + TTL_MS)
        # The floor must write exactly what the library writes.
        assert first == encode_holder(HolderRecord(ENGINE_ID, 1, claimed_at + TTL_MS, claimed_at))
        self.current = dict.fromkeys(self.keys, first)
        # Cached per key, as the registry caches them per tracked claim: the bytes before and
        # after the packed expires_at value.
        marker = msgpack.packb("expires_at") + msgpack.packb(claimed_at + TTL_MS)
        at = first.index(marker) + len(msgpack.packb("expires_at"))
        tail_len = len(first) - at - len(msgpack.packb(claimed_at + TTL_MS))
        self.splits = {key: (first[:at], first[len(first) - tail_len :]) for key in self.keys}
        probe = claimed_at + TTL_MS + 1
        head, tail = self.splits[self.keys[0]]
        assert head + msgpack.packb(probe) + tail == self.encode(probe)
        spec.create_raw_table(self.table)
        self.sqlite: Any = spec.raw_sqlite() if spec.backend == "sqlite" else None
        self.pg: Any = spec.raw_postgres() if spec.backend == "postgres" else None
        if same_layout:
            self._copy_library_table(first)
        else:
            self._seed(first)

    def spliced(self, expires_at: int) -> dict[str, bytes]:
        """Every key's new holder bytes: one ``packb`` per pass, spliced per key."""
        packed = msgpack.packb(expires_at)
        return {key: head + packed + tail for key, (head, tail) in self.splits.items()}

    def encode(self, expires_at: int) -> bytes:
        data = {
            "engine_id": ENGINE_ID,
            "epoch": 1,
            "expires_at": expires_at,
            "claimed_at": self.claimed_at,
        }
        packed: bytes = msgpack.packb(data, use_bin_type=True)
        return packed

    def _seed(self, value: bytes) -> None:
        rows = [(k, value) for k in self.keys]
        if self.sqlite is not None:
            self.sqlite.execute("BEGIN IMMEDIATE")
            self.sqlite.executemany(f'INSERT INTO "{self.table}" VALUES (?, ?)', rows)
            self.sqlite.execute("COMMIT")
        else:
            with self.pg.cursor() as cur:
                cur.executemany(f'INSERT INTO "{self.table}" VALUES (%s, %b)', rows)

    def _copy_library_table(self, first: bytes) -> None:
        """Copy every row of the library's table, in its storage order, into the twin."""
        order = "rowid" if self.sqlite is not None else "ctid"
        copy = (
            f'INSERT INTO "{self.table}" (key, value) '
            f'SELECT key, value FROM "{self.spec.table}" ORDER BY {order}'
        )
        if self.sqlite is not None:
            self.sqlite.execute("BEGIN IMMEDIATE")
            self.sqlite.execute(copy)
            self.sqlite.execute("COMMIT")
            read = self.sqlite.execute
        else:
            self.pg.execute(copy)
            read = self.pg.execute
        mark = "?" if self.sqlite is not None else "%s"
        for key in self.keys[:: max(1, len(self.keys) // 100)]:
            (value,) = read(
                f'SELECT value FROM "{self.table}" WHERE key = {mark}', (key,)
            ).fetchone()
            if bytes(value) != first:
                raise SystemExit(f"the library's holder of {key!r} is not the seeded one")

    def close(self) -> None:
        for conn in (self.sqlite, self.pg):
            if conn is not None:
                conn.close()

    # -- SQLite floors ----------------------------------------------------------------------

    def select_update(self) -> int:
        conn, current, new = self.sqlite, self.current, {}
        select = f'SELECT value FROM "{self.table}" WHERE key = ?'
        update = f'UPDATE "{self.table}" SET value = ? WHERE key = ?'
        packed = msgpack.packb(system_clock() + TTL_MS)
        splits = self.splits
        conn.execute("BEGIN IMMEDIATE")
        for key in self.keys:
            row = conn.execute(select, (key,)).fetchone()
            if row is not None and row[0] == current[key]:
                head, tail = splits[key]
                value = head + packed + tail
                conn.execute(update, (value, key))
                new[key] = value
        conn.execute("COMMIT")
        current.update(new)
        return len(new)

    def update_where(self) -> int:
        conn, current, new = self.sqlite, self.current, {}
        update = f'UPDATE "{self.table}" SET value = ? WHERE key = ? AND value = ?'
        packed = msgpack.packb(system_clock() + TTL_MS)
        splits = self.splits
        cur = conn.cursor()
        conn.execute("BEGIN IMMEDIATE")
        for key in self.keys:
            head, tail = splits[key]
            value = head + packed + tail
            cur.execute(update, (value, key, current[key]))
            if cur.rowcount == 1:
                new[key] = value
        conn.execute("COMMIT")
        current.update(new)
        return len(new)

    def executemany(self) -> int:
        return self._executemany(self.spliced(system_clock() + TTL_MS))

    def executemany_reencoded(self) -> int:
        expires_at = system_clock() + TTL_MS
        return self._executemany({key: self.encode(expires_at) for key in self.keys})

    def _executemany(self, new: dict[str, bytes]) -> int:
        conn, current = self.sqlite, self.current
        update = f'UPDATE "{self.table}" SET value = ? WHERE key = ? AND value = ?'
        conn.execute("BEGIN IMMEDIATE")
        rows = [(new[k], k, current[k]) for k in self.keys]
        renewed: int = conn.executemany(update, rows).rowcount
        conn.execute("COMMIT")
        if renewed != len(self.keys):
            raise SystemExit("raw executemany lost a claim: the benchmark state is broken")
        current.update(new)
        return renewed

    # -- PostgreSQL floor -------------------------------------------------------------------

    def unnest(self) -> int:
        current = self.current
        new = self.spliced(system_clock() + TTL_MS)
        query = (
            f'UPDATE "{self.table}" AS t SET value = u.v '
            "FROM unnest(%b::text[], %b::bytea[], %b::bytea[]) AS u(k, e, v) "
            "WHERE t.key = u.k AND t.value = u.e RETURNING t.key"
        )
        rows = self.pg.execute(
            query, [self.keys, [current[k] for k in self.keys], [new[k] for k in self.keys]]
        ).fetchall()
        renewed = {str(row[0]) for row in rows}
        current.update((k, new[k]) for k in renewed)
        return len(renewed)

    def floors(self) -> dict[str, Callable[[], int]]:
        if self.suffix:
            if self.sqlite is not None:
                return {
                    "raw update-where" + self.suffix: self.update_where,
                    "raw executemany" + self.suffix: self.executemany,
                }
            return {"raw unnest" + self.suffix: self.unnest}
        if self.sqlite is not None:
            return {
                "raw select+update": self.select_update,
                "raw update-where": self.update_where,
                "raw executemany": self.executemany,
                "raw executemany, re-encoded": self.executemany_reencoded,
            }
        return {"raw unnest": self.unnest}


def _expect(fn: Callable[[], object], count: int, name: str) -> Callable[[], None]:
    """Wrap a renewal so that anything but ``count`` renewed claims stops the benchmark."""

    def run() -> None:
        renewed = fn()
        if renewed != count:
            raise SystemExit(f"{name} renewed {renewed} of {count} claims: state is broken")

    return run


def bench_size(
    site: Site, backend: str, size: int, repeats: int, loop_sample: int
) -> dict[str, Samples]:
    """Measure every variant on ``size`` claims (the loop on ``loop_sample`` of them)."""
    spec = site.new_store(backend, name=f"renew{size}")
    ids = workflow_ids(size)
    now = system_clock()
    with contextlib.ExitStack() as stack:
        storage = spec.open()
        stack.callback(storage.close)
        registry = new_registry(storage)
        hold_claims(registry, storage, ids, now=now)
        raw = RawHolders(spec, ids, now)
        stack.callback(raw.close)
        same = RawHolders(spec, ids, now, same_layout=True)
        stack.callback(same.close)
        pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bench-renewal")
        stack.callback(pool.shutdown)
        target = create_renewal_target(registry)
        sample = ids[:loop_sample]

        def renew_many(chunk_size: int = DEFAULT_RENEW_CHUNK_SIZE) -> int:
            results = registry.renew_many(ids, chunk_size=chunk_size)
            return sum(1 for r in results if r.status == "renewed")

        def subpass() -> int:
            return run_renewal_subpass(target, ids, executor=pool).renewed_count

        def loop() -> int:
            return sum(1 for wid in sample if registry.renew(wid).status == "renewed")

        variants = {
            "renew_many": _expect(renew_many, size, "renew_many"),
            "renew_many, one txn": _expect(lambda: renew_many(size), size, "renew_many"),
            "subpass": _expect(subpass, size, "subpass"),
            **{name: _expect(fn, size, name) for name, fn in raw.floors().items()},
            **{name: _expect(fn, size, name) for name, fn in same.floors().items()},
        }
        for fn in variants.values():  # warm caches, connections and statement plans
            fn()
        samples = interleave(variants, repeats)
        loop_samples = interleave(
            {"renew loop": _expect(loop, len(sample), "renew loop")}, max(1, repeats // 2)
        )
    scale = size / len(sample)
    loop_samples["renew loop"].wall[:] = [t * scale for t in loop_samples["renew loop"].wall]
    loop_samples["renew loop"].cpu[:] = [t * scale for t in loop_samples["renew loop"].cpu]
    return {**samples, **loop_samples}


def report(backend: str, size: int, samples: dict[str, Samples], loop_sample: int) -> list[str]:
    walls = {name: s.median_wall for name, s in samples.items()}
    cpus = {name: s.median_cpu for name, s in samples.items()}
    floor_name = min(
        (n for n in walls if n.startswith("raw") and not n.endswith(("re-encoded", SAME))),
        key=walls.__getitem__,
    )
    floor, floor_cpu = walls[floor_name], cpus[floor_name]
    same_name = min((n for n in walls if n.endswith(SAME)), key=walls.__getitem__)
    same, same_cpu = walls[same_name], cpus[same_name]
    loop = walls["renew loop"]
    rows = []
    for name, seconds in sorted(walls.items(), key=lambda item: item[1]):
        label = name
        if name == "renew loop" and size > loop_sample:
            label = f"renew loop (extrapolated from {loop_sample:,})"
        rows.append(
            [
                label,
                ms(seconds),
                us(seconds / size),
                ratio(seconds, floor),
                ratio(seconds, same),
                ms(cpus[name]),
                ratio(cpus[name], floor_cpu),
                ratio(cpus[name], same_cpu),
                ratio(loop, seconds) if name != "renew loop" else "",
            ]
        )
    print_table(
        f"{backend}, {size:,} held claims (lean floor = {floor_name}, the fastest raw variant "
        f"on holders only; same-layout floor = {same_name}, the fastest on a copy of the "
        f"library's table)",
        [
            "variant",
            "wall",
            "per claim",
            "/ lean",
            "/ same",
            "cpu",
            "cpu / lean",
            "cpu / same",
            "loop / this",
        ],
        rows,
    )
    lines = []
    if backend == "sqlite" and size in TARGET_SIZES:
        vs_loop = loop / walls["renew_many"]
        per_key = min(walls["raw select+update"], walls["raw update-where"])
        for variant in ("renew_many", "renew_many, one txn"):
            for label, base, base_cpu in (
                ("lean", floor, floor_cpu),
                ("same-layout", same, same_cpu),
            ):
                vs_floor = walls[variant] / base
                met_floor = "MET" if vs_floor <= FLOOR_TARGET else "MISSED"
                lines.append(
                    f"target sqlite {size // 1000}k: {variant} / {label} floor = {vs_floor:.2f}x "
                    f"wall, {cpus[variant] / base_cpu:.2f}x cpu (<= {FLOOR_TARGET}x: {met_floor})"
                )
            lines.append(
                f"  {variant}: / re-encoding floor "
                f"{walls[variant] / walls['raw executemany, re-encoded']:.2f}x; / fastest lean "
                f"floor with a per-key outcome {walls[variant] / per_key:.2f}x; same-layout floor"
                f" / lean floor {same / floor:.2f}x"
            )
        met_loop = "MET" if vs_loop >= LOOP_TARGET else "MISSED"
        lines.append(
            f"target sqlite {size // 1000}k: loop / renew_many = {vs_loop:.0f}x "
            f"(>= {LOOP_TARGET:.0f}x: {met_loop})"
        )
    return lines


def main() -> None:
    args = parse_args(__doc__)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    repeats = args.repeats or (3 if args.quick else 5)
    loop_sample = 1_000 if args.quick else 5_000
    print(f"renewal pass benchmark; {machine_note()}; median of {repeats} repeats")
    verdicts: list[str] = []
    backends = selected_backends(args)
    with bench_site(backends) as site:
        for backend in backends:
            for size in sizes:
                reps = repeats if size <= TARGET_SIZE else max(3, repeats - 2)
                samples = bench_size(site, backend, size, reps, min(size, loop_sample))
                verdicts += report(backend, size, samples, min(size, loop_sample))
    print()
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
