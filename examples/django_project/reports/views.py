"""``POST /jobs/`` starts a report job, ``GET /jobs/<id>/`` shows it (JSON)."""

from __future__ import annotations

import json
import os

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_http_methods

from weft_sync.django import get_ownership

from .jobs import start_report
from .models import Report


@csrf_exempt  # A JSON API for scripts; the admin keeps Django's CSRF protection.
@require_http_methods(["GET", "POST"])
def jobs(request: HttpRequest) -> HttpResponse:
    """``POST`` (``pages=N`` as a form field or JSON) starts a job; ``GET`` counts them."""
    if request.method == "GET":
        return JsonResponse(
            {
                "running": Report.objects.filter(status="running").count(),
                "completed": Report.objects.filter(status="completed").count(),
            }
        )
    raw = request.POST.get("pages")
    if raw is None and request.content_type == "application/json":
        try:
            raw = json.loads(request.body or b"{}").get("pages")
        except (ValueError, AttributeError):
            return JsonResponse({"error": "the body is not a JSON object"}, status=400)
    try:
        pages = int(raw if raw is not None else 3)
        job_id = start_report(pages)
    except (TypeError, ValueError) as exc:
        return JsonResponse({"error": f"bad pages {raw!r}: {exc}"}, status=400)
    ownership = get_ownership()
    return JsonResponse(
        {"id": job_id, "status": "running", "pid": os.getpid(), "engine": ownership.engine_id},
        status=201,
    )


@require_GET
def job(request: HttpRequest, job_id: str) -> HttpResponse:
    """The job's report row and its workflow's status, result and holder."""
    report = Report.objects.filter(pk=job_id).first()
    if report is None:
        return JsonResponse({"error": f"no job {job_id!r}"}, status=404)
    workflows = get_ownership().workflows
    record = workflows.get(job_id)
    outcome = workflows.get_outcome(job_id)
    return JsonResponse(
        {
            "id": job_id,
            "status": record.status if record else "unknown",
            "pages": report.pages,
            "pages_done": report.pages_done,
            "completions": report.completions,
            "completed_by_pid": report.completed_by_pid,
            "result": outcome.result if outcome else None,
        }
    )
