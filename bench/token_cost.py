"""What the 16-byte epoch token costs a renewal pass and a fenced write, against 8-byte epochs.

One process, one store per backend, two sets of claims side by side: one minted with the old
8-byte epoch format (``encode_epoch``, what every mint wrote before tokens), one minted with
tokens (number + 8-byte random mint id). Then, the two sets taking turns (round-robin, so drift
hits both alike):

- ``renewal pass``: ``renew_many`` of all ``--claims`` claims of one set (one engine each);
- ``ledger write``: ``Workflows.save_checkpoint`` (a fenced CAS on the epoch key) of one of
  the set's workflows, ``--ops`` times per sample;
- ``host write`` (SQLite only): a one-row ``UPDATE`` of a host table in
  ``Ownership.fenced(workflow_id, sqlite3_connection)``, ``--ops`` times per sample.

The whole comparison runs twice per backend, with the formats' places swapped: the first
engine (and its rows) holds the old format and the second the token, then the other way round.
Two sets of the same format differ by a few percent on PostgreSQL (which engine, which rows), so
one arrangement alone would credit that difference to the format; the geometric mean of the two
arrangements' ratios cancels it. Prints the median wall time of each (the mean over both
arrangements), both arrangements' ratios, their mean (and the same for this process's CPU
time, steadier on a shared machine but blind to a server's work), with the machine's load
average.

    python bench/token_cost.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
        [--claims 2000] [--ops 200]
"""

from __future__ import annotations

import argparse
import functools
import math
import sqlite3
import sys
import timeit
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Samples,
    StoreSpec,
    bench_site,
    machine_note,
    parse_args,
    print_table,
    ratio,
    selected_backends,
    us,
    workflow_ids,
)
from weft_sync import Ownership
from weft_sync.claims import transitions
from weft_sync.codec import decode_epoch, encode_epoch, mint_token
from weft_sync.options import OwnershipOptions

OPTIONS = OwnershipOptions(claim_ttl=60_000, claim_renew_interval=10_000)


def _minting(old_format: bool) -> AbstractContextManager[object]:
    """Mint the old 8-byte format while the block runs (how every mint wrote before tokens).

    Every mint of a claim (acquire, takeover, rotation) calls the ``mint_token`` that
    ``weft_sync.claims.transitions`` imported from ``weft_sync.codec``, so that is the name
    replaced; the original is put back when the block exits.
    """
    return mock.patch.object(transitions, "mint_token", encode_epoch if old_format else mint_token)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--claims", type=int, default=2000, help="claims per set")
    parser.add_argument("--ops", type=int, default=200, help="fenced writes per sample")


def _engine(url: str, name: str, ids: list[str], old_format: bool) -> Ownership:
    own = Ownership.open(url, engine_id=name, options=OPTIONS, background="manual")
    with _minting(old_format):
        for wid in ids:
            own.workflows.start(wid, "bench")
    return own


def main() -> None:
    args = parse_args(__doc__, _configure)
    claims = 300 if args.quick else args.claims
    ops = 50 if args.quick else args.ops
    repeats = args.repeats or (5 if args.quick else 11)
    rows: list[list[object]] = []
    with bench_site(selected_backends(args)) as site:
        for backend in selected_backends(args):
            arrangements = []
            for old_first in (True, False):
                spec = site.new_store(backend, "tokens")
                formats = ("old", "token") if old_first else ("token", "old")
                engines = {
                    fmt: _engine(
                        spec.url, f"engine-{place}", workflow_ids(claims, place), fmt == "old"
                    )
                    for fmt, place in zip(formats, ("a", "b"), strict=True)
                }
                try:
                    for fmt, own in engines.items():
                        wid = own.registry.list_held_workflow_ids()[0]
                        size = len(own.registry.current_epoch_bytes(wid) or b"")
                        assert size == (8 if fmt == "old" else 16), (fmt, size)
                    arrangements.append(_measure(backend, spec, engines, ops, repeats))
                finally:
                    for own in engines.values():
                        own.close()
            rows += _combined(backend, arrangements)
    print_table(
        f"the work the token adds, per call (timeit, best of 5; {machine_note()})",
        ["operation", "old 8-byte", "token 16-byte", "added"],
        _added_work(),
    )
    print_table(
        f"epoch token cost ({claims} claims per set, {ops} writes per sample, {repeats} "
        f"samples; {machine_note()})",
        [
            "backend",
            "measure",
            "old 8-byte",
            "token 16-byte",
            "token / old (a, b)",
            "token / old",
            "cpu token / old",
        ],
        rows,
    )


Measured = dict[str, tuple[float, float, float, float]]
"""measure -> (old wall, token wall, old cpu, token cpu) per operation, of one arrangement."""


def _combined(backend: str, arrangements: list[Measured]) -> list[list[object]]:
    """One row per measure: mean times, each arrangement's ratio, their geometric mean."""
    rows: list[list[object]] = []
    for name in arrangements[0]:
        runs = [a[name] for a in arrangements]
        walls = [new / old for old, new, _, _ in runs]
        cpus = [new / old for _, _, old, new in runs]
        rows.append(
            [
                backend,
                name,
                us(sum(r[0] for r in runs) / len(runs)),
                us(sum(r[1] for r in runs) / len(runs)),
                " / ".join(ratio(w, 1.0) for w in walls),
                ratio(math.prod(walls) ** (1 / len(walls)), 1.0),
                ratio(math.prod(cpus) ** (1 / len(cpus)), 1.0),
            ]
        )
    return rows


def _added_work() -> list[list[object]]:
    """CPU cost of what changes per mint and per fence comparison, without any I/O."""
    old, new = encode_epoch(7), mint_token(7)
    old2, new2 = encode_epoch(7), new[:8] + new[8:]
    rows: list[list[object]] = []
    for name, before, after in (
        ("mint (acquire, takeover, rotation)", lambda: encode_epoch(7), lambda: mint_token(7)),
        ("fence comparison", lambda: old == old2, lambda: new == new2),
        ("decode the number", lambda: decode_epoch(old), lambda: decode_epoch(new)),
    ):
        times = [
            min(timeit.repeat(fn, number=100_000, repeat=5)) / 100_000 for fn in (before, after)
        ]
        rows.append(
            [
                name,
                f"{times[0] * 1e9:.0f} ns",
                f"{times[1] * 1e9:.0f} ns",
                f"{(times[1] - times[0]) * 1e9:+.0f} ns",
            ]
        )
    return rows


def _alternating(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, Samples]:
    """Like ``interleave``, but every other round runs the variants in the reverse order, so
    neither format always runs second (after the other has warmed or loaded the server)."""
    samples = {name: Samples() for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].add(variants[name])
    return samples


def _measure(
    backend: str, spec: StoreSpec, engines: dict[str, Ownership], ops: int, repeats: int
) -> Measured:
    renewals: dict[str, Callable[[], object]] = {}
    ledger: dict[str, Callable[[], object]] = {}
    host: dict[str, Callable[[], object]] = {}
    conns: list[sqlite3.Connection] = []
    for fmt, own in engines.items():
        ids = own.registry.list_held_workflow_ids()
        wid = ids[0]
        renewals[fmt] = functools.partial(own.registry.renew_many, ids)

        def save(own: Ownership = own, wid: str = wid) -> None:
            for _ in range(ops):
                own.workflows.save_checkpoint(wid, b"x")

        ledger[fmt] = save
        if backend == "sqlite":
            conn = spec.raw_sqlite()
            conns.append(conn)
            conn.execute(f'CREATE TABLE IF NOT EXISTS "host_{fmt}" (id TEXT PRIMARY KEY, v INT)')
            conn.execute(f"INSERT OR REPLACE INTO \"host_{fmt}\" VALUES ('row', 0)")

            def write(
                own: Ownership = own,
                wid: str = wid,
                conn: sqlite3.Connection = conn,
                fmt: str = fmt,
            ) -> None:
                for i in range(ops):
                    with own.fenced(wid, conn) as c:
                        c.execute(f"UPDATE \"host_{fmt}\" SET v = ? WHERE id = 'row'", (i,))

            host[fmt] = write
    out: Measured = {}
    try:
        for name, variants, per in (
            ("renewal pass", renewals, 1),
            ("ledger write", ledger, ops),
            ("host write", host, ops),
        ):
            if not variants:
                continue
            for fn in variants.values():
                fn()  # warm up
            samples = _alternating(variants, repeats)
            old, new = samples["old"].median_wall / per, samples["token"].median_wall / per
            cpu_old, cpu_new = samples["old"].median_cpu, samples["token"].median_cpu
            out[name] = (old, new, cpu_old, cpu_new)
    finally:
        for conn in conns:
            conn.close()
    return out


if __name__ == "__main__":
    main()
