"""The embedded simulated control plane (``mvproxy demo``, ``mvproxy sim``, tests).

Version catalogs derived from real kube-apiserver discovery, a shared object store and
simulated kube-apiservers that real kubectl accepts; and, for ``mvproxy demo --real``
and the tests against real servers, the same layout with real etcd, kube-apiserver and
kube-controller-manager binaries. The daemon's core never imports this package: it is
a development and test harness, not part of the request path.
"""
