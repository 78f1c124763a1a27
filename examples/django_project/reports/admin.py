"""The reports in the admin (the workflows and claims come with ``weft_sync.django``)."""

from __future__ import annotations

from django.contrib import admin

from .models import Report, ReportEvent


@admin.register(Report)
class ReportAdmin(admin.ModelAdmin):
    list_display = ("job_id", "status", "pages_done", "pages", "completions", "completed_by_pid")
    list_filter = ("status",)


@admin.register(ReportEvent)
class ReportEventAdmin(admin.ModelAdmin):
    list_display = ("job_id", "kind", "page", "pid", "engine", "at")
    list_filter = ("kind",)
