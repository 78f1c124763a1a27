"""OpenTelemetry spans, recorded with the SDK's in-memory exporter."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from weft_sync import Ownership, OwnershipOptions
from weft_sync.clock import ManualClock
from weft_sync.errors import EngineDeposedError
from weft_sync.storage import Storage

OPTIONS = OwnershipOptions(claim_ttl=3_000, claim_renew_interval=1_000)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def engine(storage: Storage, exporter: InMemorySpanExporter) -> Iterator[Ownership]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ownership = Ownership.open(
        storage,
        options=OPTIONS,
        clock=ManualClock(1_700_000_000_000),
        background="manual",
        engine_id="engine-t",
        tracing=provider,
    )
    yield ownership
    ownership.close()
    provider.shutdown()


def _named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def test_a_full_pass_is_one_span_with_its_sub_passes_inside(
    engine: Ownership, exporter: InMemorySpanExporter
) -> None:
    engine.run_maintenance()
    spans = exporter.get_finished_spans()
    (full,) = _named(spans, "weft_sync.maintenance.pass")
    children = [
        s for s in spans if s.parent is not None and s.parent.span_id == full.context.span_id
    ]
    assert [s.name for s in children] == [
        "weft_sync.maintenance.renewal",
        "weft_sync.maintenance.reclaim",
        "weft_sync.maintenance.signal_poll",
        "weft_sync.maintenance.update_poll",
    ]
    assert all(s.attributes is not None for s in spans)
    assert {s.attributes["weft_sync.engine_id"] for s in spans if s.attributes} == {"engine-t"}
    assert full.start_time is not None and full.end_time is not None
    assert all(
        c.start_time is not None and full.start_time <= c.start_time <= full.end_time
        for c in children
    )


def test_fenced_writes_are_spans_carrying_the_workflow_id(
    engine: Ownership, exporter: InMemorySpanExporter
) -> None:
    engine.workflows.start("wf-1", "job")
    engine.workflows.save_checkpoint("wf-1", b"one")
    (span,) = _named(exporter.get_finished_spans(), "weft_sync.fenced_write")
    assert span.attributes is not None
    assert span.attributes["weft_sync.workflow_id"] == "wf-1"
    assert span.status.status_code is StatusCode.UNSET
    assert span.end_time is not None and span.start_time is not None
    assert span.end_time >= span.start_time


def test_a_refused_fenced_write_is_an_error_span(
    engine: Ownership, exporter: InMemorySpanExporter
) -> None:
    engine.workflows.start("wf-1", "job")
    engine.workflows.cancel("wf-1")  # rotates the epoch: this engine is deposed
    # Its own cancel gave the claim up: refused without a claim-lost warning.
    with pytest.raises(EngineDeposedError):
        engine.workflows.save_checkpoint("wf-1", b"late")
    (span,) = _named(exporter.get_finished_spans(), "weft_sync.fenced_write")
    assert span.status.status_code is StatusCode.ERROR
    assert [event.name for event in span.events] == ["exception"]


def test_tracing_refuses_a_value_that_is_no_tracer_provider(storage: Storage) -> None:
    with pytest.raises(TypeError, match="TracerProvider"):
        Ownership.open(storage, background="manual", tracing="yes")


def test_without_tracing_nothing_imports_opentelemetry(storage_url: str) -> None:
    script = (
        "import sys\n"
        "from weft_sync import Ownership\n"
        "with Ownership.open(sys.argv[1], background='manual') as o:\n"
        "    o.workflows.start('wf-1', 'job')\n"
        "    o.workflows.save_checkpoint('wf-1', b'x')\n"
        "    o.run_maintenance()\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, storage_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_takeover_drive_is_a_span_with_workflow_id_type_and_epoch(
    storage: Storage, exporter: InMemorySpanExporter
) -> None:
    clock = ManualClock(1_700_000_000_000)
    with Ownership.open(
        storage, options=OPTIONS, clock=clock, background="manual", engine_id="dead"
    ) as dead:
        dead.workflows.start("wf-1", "payout")
        dead.registry.forget_local_claim("wf-1")
    clock.advance(10_000)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with Ownership.open(
        storage,
        options=OPTIONS,
        clock=clock,
        background="manual",
        engine_id="survivor",
        handlers={"payout": lambda ctx: None},
        tracing=provider,
    ) as survivor:
        survivor.run_maintenance()
    provider.shutdown()
    (span,) = _named(exporter.get_finished_spans(), "weft_sync.takeover")
    assert span.attributes is not None
    assert dict(span.attributes) == {
        "weft_sync.engine_id": "survivor",
        "weft_sync.workflow_id": "wf-1",
        "weft_sync.workflow_type": "payout",
        "weft_sync.epoch": 2,
    }
