from django.urls import path
from rest_framework.routers import SimpleRouter

from . import billing, capacity_planning, catalog, deployments, models, orders

router = SimpleRouter()
router.register("catalog/gpu-models", catalog.GpuModelViewSet, basename="gpumodel")
router.register("catalog/mig-profiles", catalog.MigProfileViewSet, basename="migprofile")
router.register("catalog/platforms", catalog.ServerPlatformViewSet, basename="platform")
router.register("fleet/nodes", catalog.NodeViewSet, basename="node")
router.register("fleet/gpus", catalog.GpuViewSet, basename="gpu")
router.register("fleet/instances", catalog.GpuInstanceViewSet, basename="gpuinstance")

router.register("fleet/drift", orders.DriftEventViewSet, basename="drift")
router.register("tiers", orders.TierViewSet, basename="tier")
router.register("price-plans", orders.PricePlanViewSet, basename="priceplan")
router.register("orders", orders.OrderViewSet, basename="order")
router.register("allocations", orders.AllocationViewSet, basename="allocation")
router.register("deployments", deployments.DeploymentViewSet, basename="deployment")
router.register("model-repositories", models.ModelRepositoryViewSet, basename="modelrepository")
router.register("library", models.LibraryModelViewSet, basename="librarymodel")
router.register("lora-adapters", models.LoraAdapterViewSet, basename="loraadapter")

router.register("invoices", billing.InvoiceViewSet, basename="invoice")
router.register("webhooks", billing.WebhookEndpointViewSet, basename="webhook")
router.register("credit-notes", billing.CreditNoteViewSet, basename="creditnote")

urlpatterns = [
    path("billing/spend/", billing.SpendView.as_view(), name="billing-spend"),
    path("billing/usage/", billing.UsageSummaryView.as_view(), name="billing-usage"),
    path("planner/", capacity_planning.PlannerView.as_view(), name="planner"),
    path("planner/inputs/", capacity_planning.PlannerInputsView.as_view(), name="planner-inputs"),
    path("find-tier/", models.FindTierView.as_view(), name="find-tier"),
    *router.urls,
]
