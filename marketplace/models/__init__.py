from .alerting import AlarmState
from .billing import (
    BillingAlert,
    CreditNote,
    CreditNoteLine,
    CreditNoteSequence,
    Invoice,
    InvoiceLine,
    InvoiceLineKey,
    InvoiceSequence,
    RatingRun,
    RatingRunTenant,
    SpendNotice,
    WebhookDelivery,
    WebhookEndpoint,
)
from .catalog import GpuModel, MigPlacement, MigProfile, ServerPlatform
from .deployments import ModelDeployment
from .fleet import Gpu, GpuInstance, GpuSlot, Node
from .library import LibraryModel, LoraAdapter, ModelRepository, UploadState
from .offers import PricePlan, Tier
from .orders import Allocation, AllocationEvent, DriftEvent, Order
from .serving import TritonServer

__all__ = ["GpuModel", "MigProfile", "MigPlacement", "ServerPlatform", "Node", "Gpu", "GpuInstance", "GpuSlot",
           "Tier", "PricePlan", "Order", "Allocation", "AllocationEvent", "DriftEvent",
           "ModelDeployment", "Invoice", "InvoiceLine", "InvoiceLineKey", "InvoiceSequence", "SpendNotice",
           "WebhookEndpoint", "WebhookDelivery", "TritonServer", "LibraryModel", "ModelRepository", "LoraAdapter",
           "UploadState", "BillingAlert",
            "CreditNote", "CreditNoteLine", "CreditNoteSequence", "RatingRun", "RatingRunTenant",
           "AlarmState"]
