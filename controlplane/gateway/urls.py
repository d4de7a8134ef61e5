from django.urls import include, path

from controlplane.gateway import completions, jobs_api, views

urlpatterns = [
    path("models", views.ModelList.as_view()),
    path("models/<path:model_id>", views.ModelDetail.as_view()),
    path("chat/completions", completions.chat_completions),
    path("completions", completions.completions),
    path("jobs", jobs_api.JobList.as_view()),
    path("jobs/<str:job_id>", jobs_api.JobDetail.as_view()),
    path("jobs/<str:job_id>/cancel", jobs_api.JobCancel.as_view()),
    path("", include("controlplane.events.urls")),
]
