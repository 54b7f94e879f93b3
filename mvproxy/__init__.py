"""mvproxy: the Kubernetes Mixed Version Proxy as a sidecar.

Importing the package has no side effects; the daemon is assembled in ``app`` and
started from ``cli``.
"""

__version__ = "0.1.0"
