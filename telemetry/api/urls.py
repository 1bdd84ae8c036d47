from django.urls import path
from rest_framework.routers import SimpleRouter

from . import views

router = SimpleRouter()
router.register("usage/hourly", views.UsageHourlyViewSet, basename="usagehourly")

urlpatterns = [
    path("usage/events/", views.UsageEventsView.as_view(), name="usage-events"),
    path("usage/metered-vs-served/", views.MeteredVsServedView.as_view(), name="usage-metered-vs-served"),
    *router.urls,
]
