from .catalog import GpuModel, MigPlacement, MigProfile, ServerPlatform
from .fleet import Gpu, GpuInstance, GpuSlot, Node

__all__ = ["GpuModel", "MigProfile", "MigPlacement", "ServerPlatform", "Node", "Gpu", "GpuInstance", "GpuSlot"]
