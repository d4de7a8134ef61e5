from django.urls import path

from controlplane.gateway import views

urlpatterns = [
    path("models", views.ModelList.as_view()),
    path("models/<path:model_id>", views.ModelDetail.as_view()),
]
