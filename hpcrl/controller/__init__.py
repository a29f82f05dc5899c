"""The single-controller runtime: one driver, one WorkerGroup of Ray actors per role."""
from hpcrl.controller.dispatch import Dispatch, DispatchMode, register, register_dispatch
from hpcrl.controller.resource_pool import ResourcePool, ResourcePoolError
from hpcrl.controller.worker import Worker, local_worker
from hpcrl.controller.deadline import DeadlinePolicy
from hpcrl.controller.worker_group import (CallAbandoned, GroupFuture, RoleHung, RoleRestartLimit, RoleStateLost, WorkerGroup,
                                         follow_nodes)

__all__ = ["Dispatch", "DispatchMode", "register", "register_dispatch", "ResourcePool", "ResourcePoolError",
           "Worker", "local_worker", "WorkerGroup", "GroupFuture", "RoleRestartLimit", "RoleStateLost",
           "follow_nodes", "CallAbandoned", "RoleHung", "DeadlinePolicy"]
