# Placeholder until the console views land (helper owns this file).
urlpatterns = []
