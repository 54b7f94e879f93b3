"""mvproxy: the Kubernetes Mixed Version Proxy as a sidecar.

Importing the package has no side effects beyond ``MVPROXY_PURE=1`` (``compiled``:
import the pure-Python core even where it is compiled); the daemon is assembled in
``app`` and started from ``cli``.
"""

from mvproxy import compiled as _compiled

__version__ = "0.1.0"

if _compiled.pure_requested():
    _compiled.install_pure_finder()
