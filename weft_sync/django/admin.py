"""A read-only admin for the store's workflows and claims, with a "cancel" action.

Both pages read the store through this process's ``Ownership`` (:func:`get_ownership`) and show
at most :data:`PAGE_SIZE` rows. Nothing can be added, changed or deleted; cancelling (which
rotates the epoch and so deposes the owner, wherever it runs) needs the
``weft_sync.cancel_workflow`` permission.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone

from weft_sync import keys
from weft_sync.clock import system_clock
from weft_sync.codec import WORKFLOW_STATUSES, decode_holder
from weft_sync.errors import WeftError
from weft_sync.storage import storage_get_many

from .models import Claim, Workflow
from .runtime import get_ownership

PAGE_SIZE: Final = 200


@dataclass(frozen=True, slots=True)
class _Row:
    workflow_id: str
    type: str
    status: str
    updated: Any
    holder: str
    epoch: int | None
    expiry: str


class _ReadOnlyAdmin(admin.ModelAdmin):
    template: str = ""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view(self.changelist_view)
        return [path("", view, name=f"{info[0]}_{info[1]}_changelist")]

    def _render(self, request: HttpRequest, context: dict[str, Any]) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"weft_sync {self.opts.verbose_name_plural}",
            **context,
        }
        return TemplateResponse(request, self.template, context)


@admin.register(Workflow)
class WorkflowAdmin(_ReadOnlyAdmin):
    """Workflow records, optionally by status, each with its current holder."""

    template = "admin/weft_sync/workflows.html"

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        can_cancel = request.user.has_perm("weft_sync.cancel_workflow")
        if request.method == "POST":
            if not can_cancel:
                raise PermissionDenied
            self._cancel(request, request.POST.getlist("workflow_id"))
            return HttpResponseRedirect(request.get_full_path())
        status = request.GET.get("status") or None
        if status not in (None, *WORKFLOW_STATUSES):
            messages.error(request, f"unknown status {status!r}; showing every workflow")
            status = None
        return self._render(
            request,
            {
                "rows": _workflow_rows(status),
                "status": status,
                "statuses": WORKFLOW_STATUSES,
                "can_cancel": can_cancel,
                "page_size": PAGE_SIZE,
            },
        )

    def _cancel(self, request: HttpRequest, workflow_ids: list[str]) -> None:
        if not workflow_ids:
            messages.warning(request, "select the workflows to cancel first")
            return
        workflows = get_ownership().workflows
        for workflow_id in workflow_ids:
            try:
                workflows.cancel(workflow_id)
            except (WeftError, ValueError) as exc:
                messages.error(request, f"could not cancel {workflow_id!r}: {exc}")
            else:
                messages.success(request, f"cancelled {workflow_id!r}")


@admin.register(Claim)
class ClaimAdmin(_ReadOnlyAdmin):
    """Every claim: workflow id, holder engine, epoch, and when it expires."""

    template = "admin/weft_sync/claims.html"

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return self._render(request, {"rows": _claim_rows(), "page_size": PAGE_SIZE})


def _expiry(expires_at: int, now: int) -> str:
    delta = (expires_at - now) / 1000
    return f"in {delta:.1f}s" if delta >= 0 else f"expired {-delta:.1f}s ago"


def _workflow_rows(status: str | None) -> list[_Row]:
    ownership = get_ownership()
    records = ownership.workflows.list(status=status, limit=PAGE_SIZE)
    holders = storage_get_many(
        ownership.storage, [keys.workflow_owner_holder(r.workflow_id) for r in records]
    )
    now = system_clock()
    rows = []
    for record, raw in zip(records, holders, strict=True):
        holder = None if raw is None else decode_holder(raw)
        rows.append(
            _Row(
                workflow_id=record.workflow_id,
                type=record.type,
                status=record.status,
                updated=_when(record.updated_at),
                holder=holder.engine_id if holder else "",
                epoch=holder.epoch if holder else None,
                expiry=_expiry(holder.expires_at, now) if holder else "",
            )
        )
    return rows


def _claim_rows() -> list[_Row]:
    ownership = get_ownership()
    prefix = keys.workflow_owner_holder("")
    now = system_clock()
    rows = []
    for key, raw in ownership.storage.scan(prefix, limit=PAGE_SIZE):
        holder = decode_holder(raw)
        workflow_id = keys.try_decode_key_component(key[len(prefix) :]) or key
        rows.append(
            _Row(
                workflow_id=workflow_id,
                type="",
                status="",
                updated=_when(holder.claimed_at) if holder else None,
                holder=holder.engine_id if holder else "(unreadable holder record)",
                epoch=holder.epoch if holder else None,
                expiry=_expiry(holder.expires_at, now) if holder else "",
            )
        )
    return rows


def _when(ms: int) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.get_current_timezone()) if ms else None
