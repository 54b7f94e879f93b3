"""Whether a kube-apiserver static pod runs upstream's own peer proxy beside mvproxy.

kube-apiserver proxies requests to its peers itself (feature gate
``UnknownVersionInteroperabilityProxy``: alpha and off in 1.28-1.35, beta and on from
1.36) whenever ``--peer-ca-file`` is set. With mvproxy in front, two proxies would
route the same requests by two views of the fleet; the operator should turn the
built-in one off. ``check-config --kube-apiserver-manifest`` reads the manifest with
this module and warns. Pure: text in, warnings out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import yaml

from mvproxy.errors import UsageError

GATE = "UnknownVersionInteroperabilityProxy"
DEFAULT_ON_FROM = (1, 36)
_TRUE = {"1", "t", "true"}
_FALSE = {"0", "f", "false"}
_TAG = re.compile(r":v?(\d{1,4})\.(\d{1,4})(?:[.\-+@]|$)")


def warnings_for(text: str, source: str) -> list[str]:
    """What ``check-config`` should tell the operator about the manifest ``text``."""
    args, image = _kube_apiserver(text, source)
    peer_ca = _flag(args, "--peer-ca-file")
    if not peer_ca:
        return []
    gate = _gate(args)
    version = _version(image)
    if gate is False or (gate is None and version is not None and version < DEFAULT_ON_FROM):
        return []
    why = (f"{GATE}=true" if gate else
           f"{GATE} is on by default from 1.{DEFAULT_ON_FROM[1]}" if version else
           f"{GATE} is on by default from 1.{DEFAULT_ON_FROM[1]} (image version unknown)")
    return [f"{source}: kube-apiserver runs its built-in mixed version proxy "
            f"(--peer-ca-file is set and {why}); beside mvproxy two proxies would route "
            f"the same requests from different views of the fleet. Remove --peer-ca-file "
            f"(and --peer-advertise-ip/--peer-advertise-port), or set "
            f"--feature-gates={GATE}=false"]


def _kube_apiserver(text: str, source: str) -> tuple[list[str], str]:
    """(command + args, image) of the manifest's kube-apiserver container; UsageError
    for anything that is not a Pod-shaped document."""
    try:
        pod = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise UsageError(f"{source}: not valid YAML: {str(exc)[:300]}") from None
    spec = pod.get("spec") if isinstance(pod, dict) else None
    containers = spec.get("containers") if isinstance(spec, dict) else None
    for container in containers if isinstance(containers, list) else ():
        if not isinstance(container, dict):
            continue
        words = _strings(container, "command", source) + _strings(container, "args", source)
        if container.get("name") == "kube-apiserver" or (
                words and words[0].rsplit("/", 1)[-1] == "kube-apiserver"):
            image = container.get("image")
            return words, image if isinstance(image, str) else ""
    raise UsageError(f"{source}: no kube-apiserver container in spec.containers")


def _strings(container: dict, key: str, source: str) -> list[str]:
    """A container's ``command`` or ``args``: a list of strings, or absent."""
    value = container.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise UsageError(f"{source}: spec.containers[].{key} must be a list of strings")
    return value


def _values(args: Iterable[str], flag: str) -> list[str]:
    """Every value of ``flag`` (``--flag=value`` or ``--flag value``), as pflag reads."""
    found, words = [], list(args)
    for i, word in enumerate(words):
        if word.startswith(flag + "="):
            found.append(word[len(flag) + 1:])
        elif word == flag and i + 1 < len(words):
            found.append(words[i + 1])
    return found


def _flag(args: list[str], flag: str) -> str:
    values = _values(args, flag)
    return values[-1].strip() if values else ""


def _gate(args: list[str]) -> bool | None:
    """The gate's explicit value (the last one wins, as pflag merges), or None."""
    value = None
    for gates in _values(args, "--feature-gates"):
        for item in gates.split(","):
            name, _, setting = item.partition("=")
            if name.strip() == GATE:
                setting = setting.strip().lower()
                value = True if setting in _TRUE else False if setting in _FALSE else value
    return value


def _version(image: str) -> tuple[int, int] | None:
    match = _TAG.search(image.rsplit("/", 1)[-1])
    return (int(match[1]), int(match[2])) if match else None
