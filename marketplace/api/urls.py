from rest_framework.routers import SimpleRouter

from . import catalog

router = SimpleRouter()
router.register("catalog/gpu-models", catalog.GpuModelViewSet, basename="gpumodel")
router.register("catalog/mig-profiles", catalog.MigProfileViewSet, basename="migprofile")
router.register("catalog/platforms", catalog.ServerPlatformViewSet, basename="platform")
router.register("fleet/nodes", catalog.NodeViewSet, basename="node")
router.register("fleet/gpus", catalog.GpuViewSet, basename="gpu")
router.register("fleet/instances", catalog.GpuInstanceViewSet, basename="gpuinstance")

urlpatterns = router.urls
