"""The public surface, pinned: what ``weft_sync`` promises and nothing more.

Public are ``weft_sync``'s top level, the storage protocol a custom backend implements and the
two backends, the modules the API contract (``api.md``) names, the CLI entry point and the
integrations. Each public module lists its names in ``__all__``; every other module is private
and declares no ``__all__`` (its names may change without notice). A name added to or removed
from the surface is a deliberate edit of :data:`PUBLIC_SURFACE`.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import weft_sync

PACKAGE = Path(weft_sync.__file__).parent

# Every ``__all__`` of the package, module by module.
PUBLIC_SURFACE: dict[str, tuple[str, ...]] = {
    "weft_sync": (
        "ClaimHandle",
        "ClaimMetrics",
        "ClaimRegistry",
        "Condition",
        "Delete",
        "EngineDeposedError",
        "ManualClock",
        "Ownership",
        "OwnershipModeMismatchError",
        "OwnershipOptions",
        "PostgresStorage",
        "Put",
        "ReclaimedWorkflow",
        "SqliteStorage",
        "StorageError",
        "WeftError",
        "WorkflowClaimLostError",
        "WorkflowClaimLostWarning",
        "WorkflowClaimUnavailableError",
        "WorkflowExistsError",
        "WorkflowHandler",
        "open_storage",
        "system_clock",
    ),
    "weft_sync.claims": (
        "AcquirePreparation",
        "AcquireResult",
        "AcquireStatus",
        "ClaimRegistry",
        "ClaimRenewalLostError",
        "CorruptEpoch",
        "DEFAULT_RENEW_CHUNK_SIZE",
        "Fragment",
        "OWNERSHIP_MODES",
        "OwnershipModeName",
        "OwnershipOptions",
        "RegistryRenewalTarget",
        "ReleasePreparation",
        "ReleaseResult",
        "ReleaseStatus",
        "RenewResult",
        "RenewStatus",
        "StoreClock",
        "TAKEOVER_GRACE_MULTIPLIER",
        "TTL_SAFETY_MULTIPLIER",
        "TakeoverCooldown",
        "TakeoverResult",
        "TakeoverStatus",
        "WarnSink",
        "assert_ownership_mode_marker",
        "assert_ownership_storage_capability",
        "bootstrap_ownership_gates",
        "build_acquire_transition",
        "build_external_rotation_transition",
        "build_release_transition",
        "build_renew_transition",
        "build_takeover_transition",
        "create_renewal_target",
        "extract_put_value",
        "find_corrupt_epochs",
        "is_claim_expired",
        "next_epoch",
        "parse_duration",
        "repair_corrupt_epoch",
    ),
    "weft_sync.cli": (
        "DEFAULT_URL",
        "EXIT_FAILURE",
        "EXIT_INTERRUPTED",
        "EXIT_NOT_FOUND",
        "EXIT_OK",
        "EXIT_USAGE",
        "main",
    ),
    "weft_sync.clock": (
        "Clock",
        "ManualClock",
        "system_clock",
    ),
    "weft_sync.codec": (
        "EPOCH_MAX",
        "EPOCH_TOKEN_SIZE",
        "EpochToken",
        "HolderRecord",
        "MINT_ID_SIZE",
        "ModeMarker",
        "OwnershipMode",
        "SAFE_INT_MAX",
        "WORKFLOW_STATUSES",
        "WorkflowRecord",
        "decode_epoch",
        "decode_holder",
        "decode_mode_marker",
        "decode_token",
        "decode_workflow_record",
        "encode_epoch",
        "encode_holder",
        "encode_mode_marker",
        "encode_token",
        "encode_workflow_record",
        "mint_token",
        "try_decode_workflow_record",
    ),
    "weft_sync.django": (
        "close_ownership",
        "fenced_atomic",
        "get_ownership",
    ),
    "weft_sync.errors": (
        "ClosedError",
        "CorruptEpochError",
        "CorruptOwnershipMarkerError",
        "EngineDeposedError",
        "EpochExhaustedError",
        "FencedWriteConflict",
        "MissingStoreError",
        "OwnershipModeMismatchError",
        "ReadOnlyStorageError",
        "StorageCapabilityError",
        "StorageError",
        "StoreIdentityError",
        "WeftError",
        "WorkflowClaimLostError",
        "WorkflowClaimLostWarning",
        "WorkflowClaimUnavailableError",
        "WorkflowExistsError",
        "WorkflowWakeDiscardedWarning",
    ),
    "weft_sync.flask": (
        "EXTENSION_KEY",
        "WeftSync",
        "close_all",
        "gunicorn_post_worker_init",
        "gunicorn_worker_exit",
    ),
    "weft_sync.keys": (
        "OWNERSHIP_MODE_MARKER",
        "OWNER_INDEX_MARKER",
        "decode_canonical_component",
        "decode_key_component",
        "decode_owner_by_engine_key",
        "encode_key_component",
        "engine_liveness",
        "try_decode_key_component",
        "validate_workflow_id",
        "workflow",
        "workflow_owner_by_engine",
        "workflow_owner_by_engine_prefix",
        "workflow_owner_epoch",
        "workflow_owner_holder",
        "workflow_status_index",
    ),
    "weft_sync.maintenance": (
        "AUTHORITATIVE_SCAN_LIMIT",
        "BatchReclaimTarget",
        "BatchRenewalTarget",
        "EligibilityPredicate",
        "IntervalScheduler",
        "LiveSignalWaiter",
        "OwnershipBootstrap",
        "ParkedOperation",
        "ParkedSignalWait",
        "PassCallback",
        "PassKind",
        "PassResult",
        "RECLAIM_CHUNK_SIZE",
        "RECLAIM_CONCURRENCY",
        "RENEWAL_CHUNK_SIZE",
        "RENEWAL_CONCURRENCY",
        "ReclaimAttemptResult",
        "ReclaimOutcome",
        "ReclaimOutcomeStatus",
        "ReclaimPassResult",
        "ReclaimPassStatus",
        "ReclaimTarget",
        "ReclaimTargetHandle",
        "RenewalOutcome",
        "RenewalStatus",
        "RenewalSubpassResult",
        "RenewalTarget",
        "RenewalTask",
        "SignalPollOutcome",
        "SignalPollResult",
        "SignalPollSources",
        "SignalPollStatus",
        "SignalPollSubpassResult",
        "SignalPollTarget",
        "SignalWakeDecision",
        "SubpassStatus",
        "TAKEOVER_MAX_ATTEMPTS",
        "TimerScheduler",
        "UpdatePollOutcome",
        "UpdatePollResult",
        "UpdatePollStatus",
        "UpdatePollSubpassResult",
        "UpdatePollTarget",
        "WAIT_SIGNAL",
        "bootstrap_workflow_lease_ownership",
        "build_owner_side_signal_poll_target",
        "create_reclaim_target",
        "create_renewal_target",
        "create_renewal_task",
        "list_reclaim_candidates",
        "metrics_bridge",
        "run_owner_side_signal_poll",
        "run_owner_side_update_poll",
        "run_reclaim_pass",
        "run_renewal_subpass",
        "run_signal_poll_subpass",
        "run_update_poll_subpass",
    ),
    "weft_sync.metrics": (
        "CLAIM_ATTEMPT_OUTCOMES",
        "CLAIM_LOSS_CAUSES",
        "ClaimAttemptOutcome",
        "ClaimLossCause",
        "ClaimMetrics",
        "ClaimMetricsCollector",
        "Family",
        "MAX_TYPE_LABELS",
        "MetricsSnapshot",
        "SUBPASSES",
        "Subpass",
        "metric_families",
        "register_prometheus",
        "serialize_prometheus",
    ),
    "weft_sync.ownership": (
        "Background",
        "ClaimHandle",
        "LostCallback",
        "Ownership",
        "ReclaimedWorkflow",
        "WorkflowHandler",
    ),
    "weft_sync.storage": (
        "Batch",
        "CasRow",
        "Condition",
        "Decide",
        "Decision",
        "Delete",
        "Operation",
        "PostgresStorage",
        "Put",
        "SessionLock",
        "SqliteStorage",
        "Storage",
        "StorageCapabilities",
        "SupportsCompareAndSetMany",
        "SupportsGetMany",
        "SupportsReadThenWrite",
        "SupportsSessionLocks",
        "SupportsWaitBound",
        "open_storage",
        "storage_compare_and_set_many",
        "storage_conditional_batch",
        "storage_get_many",
        "storage_read_then_write",
        "storage_session_locks",
    ),
    "weft_sync.storage.postgres": ("PostgresStorage",),
    "weft_sync.storage.sqlite": ("SqliteStorage",),
    "weft_sync.workflows": (
        "DriveContext",
        "EXTERNAL_MAX_ATTEMPTS",
        "ExternalCommitConflictError",
        "WorkflowNotFoundError",
        "WorkflowOutcome",
        "WorkflowSignalPollTarget",
        "WorkflowStateError",
        "WorkflowUpdate",
        "WorkflowUpdatePollTarget",
        "Workflows",
    ),
}

# What the API contract names, by the module its heading gives (attributes and methods of
# these are covered by the behaviour tests).
API_CONTRACT: dict[str, tuple[str, ...]] = {
    "weft_sync.clock": ("system_clock", "ManualClock"),
    "weft_sync.errors": (
        "WeftError",
        "StorageError",
        "StorageCapabilityError",
        "OwnershipModeMismatchError",
        "CorruptOwnershipMarkerError",
        "WorkflowClaimUnavailableError",
        "EngineDeposedError",
        "ClosedError",
        "WorkflowClaimLostWarning",
        "WorkflowWakeDiscardedWarning",
        "WorkflowClaimLostError",
        "FencedWriteConflict",
        "StoreIdentityError",
        "EpochExhaustedError",
    ),
    "weft_sync.storage": (
        "Condition",
        "Put",
        "Delete",
        "Operation",
        "StorageCapabilities",
        "Storage",
        "SqliteStorage",
        "PostgresStorage",
        "open_storage",
        "storage_conditional_batch",
        "storage_compare_and_set_many",
        "storage_get_many",
    ),
    "weft_sync.storage.sqlite": ("SqliteStorage",),
    "weft_sync.storage.postgres": ("PostgresStorage",),
    "weft_sync.keys": (
        "encode_key_component",
        "decode_key_component",
        "try_decode_key_component",
        "workflow_owner_epoch",
        "workflow_owner_holder",
        "OWNERSHIP_MODE_MARKER",
        "workflow",
        "workflow_status_index",
    ),
    "weft_sync.codec": (
        "encode_epoch",
        "decode_epoch",
        "HolderRecord",
        "encode_holder",
        "decode_holder",
        "ModeMarker",
        "encode_mode_marker",
        "decode_mode_marker",
        "WorkflowRecord",
        "encode_workflow_record",
        "decode_workflow_record",
    ),
    "weft_sync.claims": (
        "Fragment",
        "build_acquire_transition",
        "build_renew_transition",
        "build_release_transition",
        "build_takeover_transition",
        "build_external_rotation_transition",
        "is_claim_expired",
        "extract_put_value",
        "TTL_SAFETY_MULTIPLIER",
        "TAKEOVER_GRACE_MULTIPLIER",
        "TakeoverCooldown",
        "ClaimRegistry",
        "AcquireResult",
        "RenewResult",
        "ReleaseResult",
        "TakeoverResult",
        "AcquirePreparation",
        "bootstrap_ownership_gates",
        "assert_ownership_storage_capability",
        "assert_ownership_mode_marker",
        "OwnershipOptions",
        "parse_duration",
    ),
    "weft_sync.metrics": (
        "ClaimMetrics",
        "MetricsSnapshot",
        "CLAIM_ATTEMPT_OUTCOMES",
        "serialize_prometheus",
        "register_prometheus",
    ),
    "weft_sync.maintenance": (
        "RenewalTarget",
        "ReclaimTarget",
        "BatchReclaimTarget",
        "SignalPollTarget",
        "ParkedSignalWait",
        "UpdatePollTarget",
        "RENEWAL_CONCURRENCY",
        "RECLAIM_CONCURRENCY",
        "RECLAIM_CHUNK_SIZE",
        "TAKEOVER_MAX_ATTEMPTS",
        "AUTHORITATIVE_SCAN_LIMIT",
        "run_renewal_subpass",
        "RenewalSubpassResult",
        "RenewalOutcome",
        "run_reclaim_pass",
        "ReclaimPassResult",
        "run_owner_side_signal_poll",
        "SignalPollResult",
        "run_owner_side_update_poll",
        "UpdatePollResult",
        "IntervalScheduler",
        "TimerScheduler",
        "create_renewal_task",
        "RenewalTask",
        "PassResult",
        "list_reclaim_candidates",
        "create_reclaim_target",
        "ReclaimTargetHandle",
        "create_renewal_target",
        "build_owner_side_signal_poll_target",
        "bootstrap_workflow_lease_ownership",
        "OwnershipBootstrap",
    ),
    "weft_sync.ownership": ("Ownership", "ReclaimedWorkflow", "WorkflowHandler", "ClaimHandle"),
    "weft_sync.workflows": ("Workflows", "DriveContext"),
    "weft_sync.flask": ("WeftSync",),
    "weft_sync.django": ("get_ownership", "fenced_atomic"),
    "weft_sync.cli": ("main",),
    "weft_sync": (
        "Ownership",
        "ReclaimedWorkflow",
        "ClaimRegistry",
        "OwnershipOptions",
        "ClaimMetrics",
        "ManualClock",
        "system_clock",
        "WeftError",
        "StorageError",
        "OwnershipModeMismatchError",
        "WorkflowClaimUnavailableError",
        "WorkflowClaimLostError",
        "WorkflowClaimLostWarning",
        "EngineDeposedError",
        "Condition",
        "Put",
        "Delete",
        "SqliteStorage",
        "PostgresStorage",
        "open_storage",
    ),
}

# What a custom backend implements or is handed: the protocol and its optional capabilities.
STORAGE_PROTOCOL = (
    "Storage",
    "StorageCapabilities",
    "Condition",
    "Put",
    "Delete",
    "Operation",
    "Batch",
    "CasRow",
    "SupportsCompareAndSetMany",
    "SupportsGetMany",
    "SupportsSessionLocks",
    "SessionLock",
    "SupportsWaitBound",
)


def _declared_all() -> dict[str, list[str] | None]:
    """Each module's literal ``__all__`` (``None`` when it declares none), read from source."""
    declared: dict[str, list[str] | None] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names: list[str] | None = None
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names = list(ast.literal_eval(node.value))
        declared[".".join(parts)] = names
    return declared


DECLARED = _declared_all()


def test_only_the_public_modules_declare_names() -> None:
    public = {module for module, names in DECLARED.items() if names}
    assert public == set(PUBLIC_SURFACE)


@pytest.mark.parametrize("module", sorted(PUBLIC_SURFACE))
def test_a_public_module_exports_exactly_its_pinned_names(module: str) -> None:
    assert sorted(DECLARED[module] or []) == list(PUBLIC_SURFACE[module])


@pytest.mark.parametrize("module", sorted(PUBLIC_SURFACE))
def test_every_public_name_is_importable_from_its_module(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC_SURFACE[module] if not hasattr(imported, name)]
    assert missing == []


@pytest.mark.parametrize("module", sorted(API_CONTRACT))
def test_what_the_api_contract_names_is_public_where_it_says(module: str) -> None:
    assert sorted(set(API_CONTRACT[module]) - set(PUBLIC_SURFACE[module])) == []


def test_the_storage_protocol_is_public_in_weft_sync_storage() -> None:
    assert sorted(set(STORAGE_PROTOCOL) - set(PUBLIC_SURFACE["weft_sync.storage"])) == []


def test_the_top_level_is_the_pinned_list() -> None:
    assert sorted(weft_sync.__all__) == list(PUBLIC_SURFACE["weft_sync"])
    assert len(weft_sync.__all__) == len(set(weft_sync.__all__))


def test_the_integrations_are_public_and_import() -> None:
    for module in ("weft_sync.flask", "weft_sync.django"):
        assert module in PUBLIC_SURFACE
        importlib.import_module(module)


def test_the_old_public_paths_keep_working() -> None:
    from weft_sync.ownership import Ownership, ReclaimedWorkflow
    from weft_sync.storage.postgres import PostgresStorage
    from weft_sync.storage.sqlite import SqliteStorage

    assert Ownership is weft_sync.Ownership
    assert ReclaimedWorkflow is weft_sync.ReclaimedWorkflow
    assert SqliteStorage is weft_sync.SqliteStorage
    assert PostgresStorage is weft_sync.PostgresStorage
    assert importlib.import_module("weft_sync.cli").main.__name__ == "main"


_WITHOUT_EXTRAS = """
import sys

class Refuse:
    blocked = ("psycopg", "psycopg_pool", "psycopg2", "prometheus_client", "opentelemetry",
               "flask", "django", "sqlalchemy")

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
import weft_sync
import weft_sync.storage.postgres
from weft_sync.storage import open_storage

store = open_storage("sqlite:///" + sys.argv[1])
store.put("k", b"v")
assert store.get("k") == b"v"
store.close()
try:
    weft_sync.PostgresStorage
except ImportError as exc:
    print("refused", "weft_sync[postgres]" in str(exc))
"""


def test_weft_sync_imports_without_any_optional_extra(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRAS, str(tmp_path / "plain.db")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused", "True"]
