"""The embedded simulated control plane (``mvproxy demo``, ``mvproxy sim``, tests).

Version catalogs derived from real kube-apiserver discovery, a shared object store and
simulated kube-apiservers that real kubectl accepts. The daemon's core never imports
this package: it is a development and test harness, not part of the request path.
"""
