"""Cost of the claim metrics on the renewal path: the same renewals with and without them.

10,000 held claims (``--claims N``) on SQLite and PostgreSQL. Each variant renews every claim
through the registry's renewal target in chunks of 1,000 ids (what the renewal sub-pass hands it),
on one registry, repeats interleaved:

- ``no metrics``: ``create_renewal_target(registry)``;
- ``metrics``: ``create_renewal_target(registry, ClaimMetrics(...))`` — one latency observation
  per batch and the pass's smallest expiry — then ``finish_pass`` (the expiry-margin gauge), as
  the metrics bridge does at the end of a renewal pass;
- ``no metrics, again``: the first variant once more, an A/A control of what order and noise
  alone make of the ratio. The overhead is measured against the faster of the two.

Target: metrics cost at most 5 % of the renewal (ratio in one run).

    python bench/metrics_overhead.py [--quick] [--repeats N] [--backend sqlite|postgres|both]
        [--claims N]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    RENEW_MS,
    TTL_MS,
    Samples,
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
    workflow_ids,
)
from weft_sync.claims.renewal_target import create_renewal_target
from weft_sync.clock import system_clock
from weft_sync.maintenance.targets import RENEWAL_CHUNK_SIZE
from weft_sync.metrics import ClaimMetrics

TARGET = 1.05


def measure(spec: StoreSpec, claims: int, repeats: int) -> tuple[dict[str, Samples], list[str]]:
    """Interleaved samples of both variants on one store; also the variant names in order."""
    ids = workflow_ids(claims)
    chunks = [ids[i : i + RENEWAL_CHUNK_SIZE] for i in range(0, len(ids), RENEWAL_CHUNK_SIZE)]
    with contextlib.closing(spec.open()) as storage:
        registry = new_registry(storage)
        hold_claims(registry, storage, ids, now=system_clock())
        bare = create_renewal_target(registry)
        metrics = ClaimMetrics(claim_ttl_ms=TTL_MS, claim_renew_interval_ms=RENEW_MS)
        measured = create_renewal_target(registry, metrics)

        def without() -> None:
            for chunk in chunks:
                bare.renew_workflow_claims(chunk)

        def with_metrics() -> None:
            for chunk in chunks:
                measured.renew_workflow_claims(chunk)
            measured.finish_pass()

        # The repeat of the first variant is an A/A control: the ratio the order and the
        # machine alone produce, which the metrics ratio should be read against.
        variants = {
            "no metrics": without,
            "metrics": with_metrics,
            "no metrics, again": without,
        }
        for fn in variants.values():
            fn()
        samples = interleave(variants, repeats)
        if metrics.snapshot().expiry_margin_seconds is None:
            raise SystemExit("the metrics variant recorded no margin: it measured nothing")
    return samples, list(variants)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--claims", type=int, default=10_000, help="held claims per store")


def main() -> None:
    args = parse_args(__doc__, _configure)
    repeats = args.repeats or (5 if args.quick else 11)
    print(f"metrics overhead; {machine_note()}; median of {repeats} repeats")
    verdicts = []
    backends = selected_backends(args)
    with bench_site(backends) as site:
        for backend in backends:
            samples, names = measure(site.new_store(backend, name="metrics"), args.claims, repeats)
            walls = {name: s.median_wall for name, s in samples.items()}
            cpus = {name: s.median_cpu for name, s in samples.items()}
            print_table(
                f"{backend}, {args.claims:,} held claims, chunks of {RENEWAL_CHUNK_SIZE:,}",
                ["variant", "wall", "/ no metrics", "cpu", "cpu / no metrics"],
                [
                    [
                        name,
                        ms(walls[name]),
                        ratio(walls[name], walls["no metrics"]),
                        ms(cpus[name]),
                        ratio(cpus[name], cpus["no metrics"]),
                    ]
                    for name in names
                ],
            )
            baseline = min(walls["no metrics"], walls["no metrics, again"])
            overhead = walls["metrics"] / baseline
            control = max(walls["no metrics"], walls["no metrics, again"]) / baseline
            verdicts.append(
                f"target {backend}: metrics / no metrics = {overhead:.3f}x wall, "
                f"{cpus['metrics'] / cpus['no metrics']:.3f}x cpu "
                f"(<= {TARGET}x: {'MET' if overhead <= TARGET else 'MISSED'}); "
                f"A/A control {control:.3f}x"
            )
    print()
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
