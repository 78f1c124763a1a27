"""URLs of the example project: the admin (weft_sync's workflows and claims too) and the jobs."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path
from reports import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("jobs/", views.jobs, name="jobs"),
    path("jobs/<str:job_id>/", views.job, name="job"),
]
