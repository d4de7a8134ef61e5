from django.urls import include, path

from controlplane.billing import limits_api
from controlplane.gateway import batches_api, completions, jobs_api, views

urlpatterns = [
    path("models", views.ModelList.as_view()),
    path("models/<path:model_id>", views.ModelDetail.as_view()),
    path("chat/completions", completions.chat_completions),
    path("completions", completions.completions),
    path("jobs", jobs_api.JobList.as_view()),
    path("jobs/<str:job_id>", jobs_api.JobDetail.as_view()),
    path("jobs/<str:job_id>/cancel", jobs_api.JobCancel.as_view()),
    path("files", batches_api.FileList.as_view()),
    path("files/<str:file_id>", batches_api.FileDetail.as_view()),
    path("files/<str:file_id>/content", batches_api.FileContent.as_view()),
    path("batches", batches_api.BatchList.as_view()),
    path("batches/<str:batch_id>", batches_api.BatchDetail.as_view()),
    path("batches/<str:batch_id>/cancel", batches_api.BatchCancel.as_view()),
    path("budget", limits_api.Budget.as_view()),
    path("api_keys/<str:prefix>/limits", limits_api.KeyLimits.as_view()),
    path("", include("controlplane.events.urls")),
    path("", include("controlplane.billing.urls")),
]
