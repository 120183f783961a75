"""An emulated Kubernetes control plane (API server on kmock) and a test kubelet on Docker.

Test infrastructure only: the Kubernetes driver's tests run the official ``kubernetes``
client against it exactly as against a cluster (a kubeconfig, a context, a namespace).
"""

from .server import ApiServer, EmulatorThread, Quota, write_kubeconfig
from .store import LEASES, NAMESPACES, NETWORK_POLICIES, PODS, Kind, Store

__all__ = [
    "LEASES",
    "NAMESPACES",
    "NETWORK_POLICIES",
    "PODS",
    "ApiServer",
    "EmulatorThread",
    "Kind",
    "Quota",
    "Store",
    "write_kubeconfig",
]
