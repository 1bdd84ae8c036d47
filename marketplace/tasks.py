"""Celery tasks: thin wrappers around services. Node tasks are sent to the node's own queue
(`node.<hostname>`) by the services, after the transaction commits."""

from __future__ import annotations

from celery import shared_task

from marketplace.services import deployments, provisioning, reconcile

NODE_TASK = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "time_limit": 300,
    "soft_time_limit": 240,
}


@shared_task(bind=True, name="tessera.provision_allocation", autoretry_for=(provisioning.TransientProvisioningError,),
             retry_backoff=2, retry_backoff_max=120, retry_jitter=True, max_retries=6, **NODE_TASK)
def provision_allocation(self, allocation_id: int) -> str:
    return provisioning.provision(allocation_id, final_attempt=self.request.retries >= self.max_retries)


@shared_task(bind=True, name="tessera.release_allocation", autoretry_for=(Exception,), retry_backoff=2,
             retry_backoff_max=120, max_retries=6, **NODE_TASK)
def release_allocation(self, allocation_id: int) -> str:
    return provisioning.release(allocation_id)


@shared_task(name="tessera.reconcile_node", **NODE_TASK)
def reconcile_node(node_id: int) -> dict:
    return reconcile.reconcile_node(node_id)


@shared_task(name="tessera.reconcile_fleet", acks_late=True, time_limit=120)
def reconcile_fleet() -> int:
    """Beat (control queue): fan out one reconcile per ready node, each on its own queue."""
    return reconcile.fan_out()


@shared_task(bind=True, name="tessera.deploy_model", autoretry_for=(OSError,), retry_backoff=2, max_retries=5,
             **NODE_TASK)
def deploy_model(self, deployment_id: int) -> str:
    return deployments.load(deployment_id)


@shared_task(bind=True, name="tessera.undeploy_model", autoretry_for=(OSError,), retry_backoff=2, max_retries=5,
             **NODE_TASK)
def undeploy_model(self, deployment_id: int) -> str:
    return deployments.unload(deployment_id)
