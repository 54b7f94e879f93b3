"""Per-kind Table columns, as kube-apiserver's built-in printers define them.

``kubectl get`` prints whatever columns the server sends (and ``-o wide`` adds those of
priority 1), so the common kinds get kube's own columns with values computed from the
stored object: READY from container statuses, STATUS from the phase, and so on. Every
value is read defensively: a badly typed field in a stored object shows as "<none>" or
0, never breaks the list for every client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NONE = "<none>"
_NAME_DOC = ("Name must be unique within a namespace. Is required when creating resources, "
             "although some resources may allow a client to request the generation of an "
             "appropriate name automatically. Name is primarily intended for creation "
             "idempotence and configuration definition. Cannot be updated. More info: "
             "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names")
_AGE_DOC = ("CreationTimestamp is a timestamp representing the server time when this object "
            "was created. It is not guaranteed to be set in happens-before order across "
            "separate operations. Clients may not set this value. It is represented in "
            "RFC3339 form and is in UTC.\n\nPopulated by the system. Read-only. Null for "
            "lists. More info: https://git.k8s.io/community/contributors/devel/sig-"
            "architecture/api-conventions.md#metadata")
_CONTAINERS_DOC = "Names of each container in the template."
_IMAGES_DOC = "Images referenced by each container in the template."

Cells = Callable[[dict, Callable[[dict], str]], list[Any]]


def col(name: str, type_: str = "string", description: str = "", *, priority: int = 0,
        fmt: str = "") -> dict:
    return {"name": name, "type": type_, "format": fmt, "description": description,
            "priority": priority}


NAME_COL = col("Name", description=_NAME_DOC, fmt="name")
AGE_COL = col("Age", description=_AGE_DOC)


@dataclass(frozen=True)
class Printer:
    columns: list[dict]
    cells: Cells  # (object, age_of) -> one value per column


# --- safe readers -------------------------------------------------------------------


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _name(obj: dict) -> str:
    return _str(_dict(obj.get("metadata")).get("name"))


def _or_none(text: str) -> str:
    return text or NONE


def _selector_text(selector: Any) -> str:
    """A map or LabelSelector as kube prints it: ``a=b,c in (d)``; empty → <none>."""
    sel = _dict(selector)
    labels = _dict(sel.get("matchLabels")) if ("matchLabels" in sel or
                                                 "matchExpressions" in sel) else sel
    parts = [f"{k}={v}" for k, v in sorted(labels.items()) if isinstance(v, str)]
    for expr in _list(sel.get("matchExpressions")):
        e = _dict(expr)
        key, op = _str(e.get("key")), _str(e.get("operator"))
        values = ",".join(sorted(v for v in _list(e.get("values")) if isinstance(v, str)))
        if op == "In":
            parts.append(f"{key} in ({values})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts) or NONE


def _containers(spec: Any) -> list[dict]:
    return [_dict(c) for c in _list(_dict(spec).get("containers"))]


# --- pods ---------------------------------------------------------------------------


def _pod_status(pod: dict) -> str:
    """STATUS: the phase, overridden by a container's waiting/terminated reason, as kube."""
    status = _dict(pod.get("status"))
    reason = _str(status.get("reason")) or _str(status.get("phase")) or "Unknown"
    for cs in reversed([_dict(c) for c in _list(status.get("containerStatuses"))]):
        state = _dict(cs.get("state"))
        waiting, terminated = _dict(state.get("waiting")), _dict(state.get("terminated"))
        if _str(waiting.get("reason")):
            reason = waiting["reason"]
        elif terminated:
            reason = _str(terminated.get("reason")) or (
                f"Signal:{_int(terminated.get('signal'))}" if _int(terminated.get("signal"))
                else f"ExitCode:{_int(terminated.get('exitCode'))}")
    if _dict(pod.get("metadata")).get("deletionTimestamp"):
        reason = "Terminating"
    return reason


def _pod_cells(pod: dict, age_of: Callable[[dict], str]) -> list[Any]:
    spec, status = _dict(pod.get("spec")), _dict(pod.get("status"))
    statuses = [_dict(c) for c in _list(status.get("containerStatuses"))]
    ready = sum(1 for c in statuses if c.get("ready") is True)
    restarts = sum(_int(c.get("restartCount")) for c in statuses)
    gates = [_str(_dict(g).get("conditionType")) for g in _list(spec.get("readinessGates"))]
    if gates:
        true = {_str(_dict(c).get("type")) for c in _list(status.get("conditions"))
                if _dict(c).get("status") == "True"}
        gates_text = f"{sum(1 for g in gates if g in true)}/{len(gates)}"
    else:
        gates_text = NONE
    return [_name(pod), f"{ready}/{len(_containers(spec))}", _pod_status(pod), str(restarts),
            age_of(pod), _or_none(_str(status.get("podIP"))),
            _or_none(_str(spec.get("nodeName"))),
            _or_none(_str(status.get("nominatedNodeName"))), gates_text]


POD = Printer([
    NAME_COL,
    col("Ready", description="The aggregate readiness state of this pod for accepting traffic."),
    col("Status", description="The aggregate status of the containers in this pod."),
    col("Restarts", description="The number of times the containers in this pod have been "
                                "restarted and when the last container in this pod has "
                                "restarted."),
    AGE_COL,
    col("IP", description="podIP address allocated to the pod. Routable at least within the "
                          "cluster. Empty if not yet allocated.", priority=1),
    col("Node", description="NodeName indicates in which node this pod is scheduled. If "
                            "empty, this pod is a candidate for scheduling by the scheduler "
                            "defined in schedulerName. Once this field is set, the kubelet for "
                            "this node becomes responsible for the lifecycle of this pod. This "
                            "field should not be used to express a desire for the pod to be "
                            "scheduled on a specific node. https://kubernetes.io/docs/concepts/"
                            "scheduling-eviction/assign-pod-node/#nodename", priority=1),
    col("Nominated Node", description="nominatedNodeName is set only when this pod preempts "
                                      "other pods on the node, but it cannot be scheduled "
                                      "right away as preemption victims receive their "
                                      "graceful termination periods. This field does not "
                                      "guarantee that the pod will be scheduled on this node. "
                                      "Scheduler may decide to place the pod elsewhere if "
                                      "other nodes become available sooner. Scheduler may "
                                      "also decide to give the resources on this node to a "
                                      "higher priority pod that is created after preemption. "
                                      "As a result, this field may be different than "
                                      "PodSpec.nodeName when the pod is scheduled.",
        priority=1),
    col("Readiness Gates", description="If specified, all readiness gates will be evaluated "
                                       "for pod readiness. A pod is ready when all its "
                                       "containers are ready AND all conditions specified in "
                                       "the readiness gates have status equal to \"True\" More "
                                       "info: https://git.k8s.io/enhancements/keps/sig-network/"
                                       "580-pod-readiness-gates", priority=1),
], _pod_cells)


# --- deployments --------------------------------------------------------------------


def _template_cells(spec: dict) -> list[str]:
    containers = _containers(_dict(_dict(spec.get("template")).get("spec")))
    return [",".join(_str(c.get("name")) for c in containers),
            ",".join(_str(c.get("image")) for c in containers),
            _selector_text(spec.get("selector"))]


def _deployment_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    desired = _int(spec.get("replicas")) if "replicas" in spec else 1
    return [_name(obj), f"{_int(status.get('readyReplicas'))}/{desired}",
            _int(status.get("updatedReplicas")), _int(status.get("availableReplicas")),
            age_of(obj), *_template_cells(spec)]


DEPLOYMENT = Printer([
    NAME_COL,
    col("Ready", description="Number of the pod with ready state"),
    # Typed "string" by kube although the cells are numbers (its printer says so).
    col("Up-to-date", description="Total number of non-terminating pods targeted by this "
                                  "deployment that have the desired template spec."),
    col("Available", description="Total number of available non-terminating pods (ready for "
                                 "at least minReadySeconds) targeted by this deployment."),
    AGE_COL,
    col("Containers", description=_CONTAINERS_DOC, priority=1),
    col("Images", description=_IMAGES_DOC, priority=1),
    col("Selector", description="Label selector for pods. Existing ReplicaSets whose pods are "
                                "selected by this will be the ones affected by this "
                                "deployment. It must match the pod template's labels.",
        priority=1),
], _deployment_cells)


# --- statefulsets -------------------------------------------------------------------


def _statefulset_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    desired = _int(spec.get("replicas")) if "replicas" in spec else 1
    return [_name(obj), f"{_int(status.get('readyReplicas'))}/{desired}", age_of(obj),
            *_template_cells(spec)[:2]]


STATEFULSET = Printer([
    NAME_COL,
    col("Ready", description="Number of the pod with ready state"),
    AGE_COL,
    col("Containers", description=_CONTAINERS_DOC, priority=1),
    col("Images", description=_IMAGES_DOC, priority=1),
], _statefulset_cells)


# --- services -----------------------------------------------------------------------


def _service_ports(spec: dict) -> str:
    out = []
    for p in (_dict(x) for x in _list(spec.get("ports"))):
        proto = _str(p.get("protocol")) or "TCP"
        node = _int(p.get("nodePort"))
        out.append(f"{_int(p.get('port'))}:{node}/{proto}" if node
                   else f"{_int(p.get('port'))}/{proto}")
    return ",".join(out) or NONE


def _service_external(spec: dict, status: dict) -> str:
    ips = [x for x in _list(spec.get("externalIPs")) if isinstance(x, str)]
    kind = _str(spec.get("type")) or "ClusterIP"
    if kind == "ExternalName":
        return _str(spec.get("externalName")) or NONE
    if kind == "LoadBalancer":
        ingress = [_str(_dict(i).get("ip")) or _str(_dict(i).get("hostname"))
                   for i in _list(_dict(status.get("loadBalancer")).get("ingress"))]
        ips = [i for i in ingress if i] + ips
        return ",".join(ips) or "<pending>"
    return ",".join(ips) or NONE


def _service_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    return [_name(obj), _str(spec.get("type")) or "ClusterIP",
            _or_none(_str(spec.get("clusterIP"))), _service_external(spec, status),
            _service_ports(spec), age_of(obj), _selector_text(spec.get("selector"))]


_SERVICE_TYPE_DOC = (
    "type determines how the Service is exposed. Defaults to ClusterIP. Valid options are "
    "ExternalName, ClusterIP, NodePort, and LoadBalancer. \"ClusterIP\" allocates a "
    "cluster-internal IP address for load-balancing to endpoints. Endpoints are determined by "
    "the selector or if that is not specified, by manual construction of an Endpoints object "
    "or EndpointSlice objects. If clusterIP is \"None\", no virtual IP is allocated and the "
    "endpoints are published as a set of endpoints rather than a virtual IP. \"NodePort\" "
    "builds on ClusterIP and allocates a port on every node which routes to the same "
    "endpoints as the clusterIP. \"LoadBalancer\" builds on NodePort and creates an external "
    "load-balancer (if supported in the current cloud) which routes to the same endpoints as "
    "the clusterIP. \"ExternalName\" aliases this service to the specified externalName. "
    "Several other fields do not apply to ExternalName services. More info: "
    "https://kubernetes.io/docs/concepts/services-networking/service/"
    "#publishing-services-service-types")
_CLUSTER_IP_DOC = (
    "clusterIP is the IP address of the service and is usually assigned randomly. If an "
    "address is specified manually, is in-range (as per system configuration), and is not in "
    "use, it will be allocated to the service; otherwise creation of the service will fail. "
    "This field may not be changed through updates unless the type field is also being "
    "changed to ExternalName (which requires this field to be blank) or the type field is "
    "being changed from ExternalName (in which case this field may optionally be specified, "
    "as describe above).  Valid values are \"None\", empty string (\"\"), or a valid IP "
    "address. Setting this to \"None\" makes a \"headless service\" (no virtual IP), which is "
    "useful when direct endpoint connections are preferred and proxying is not required.  "
    "Only applies to types ClusterIP, NodePort, and LoadBalancer. If this field is specified "
    "when creating a Service of type ExternalName, creation will fail. This field will be "
    "wiped when updating a Service to type ExternalName. More info: https://kubernetes.io/"
    "docs/concepts/services-networking/service/#virtual-ips-and-service-proxies")

SERVICE = Printer([
    NAME_COL,
    col("Type", description=_SERVICE_TYPE_DOC),
    col("Cluster-IP", description=_CLUSTER_IP_DOC),
    col("External-IP", description="externalIPs is a list of IP addresses for which nodes in "
                                    "the cluster will also accept traffic for this service.  "
                                    "These IPs are not managed by Kubernetes.  The user is "
                                    "responsible for ensuring that traffic arrives at a node "
                                    "with this IP.  A common example is external "
                                    "load-balancers that are not part of the Kubernetes "
                                    "system."),
    col("Port(s)", description="The list of ports that are exposed by this service. More "
                               "info: https://kubernetes.io/docs/concepts/services-networking/"
                               "service/#virtual-ips-and-service-proxies"),
    AGE_COL,
    col("Selector", description="Route service traffic to pods with label keys and values "
                                "matching this selector. If empty or not present, the service "
                                "is assumed to have an external process managing its "
                                "endpoints, which Kubernetes will not modify. Only applies to "
                                "types ClusterIP, NodePort, and LoadBalancer. Ignored if type "
                                "is ExternalName. More info: https://kubernetes.io/docs/"
                                "concepts/services-networking/service/", priority=1),
], _service_cells)


# --- nodes --------------------------------------------------------------------------


def _node_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    ready = next((_dict(c) for c in _list(status.get("conditions"))
                  if _dict(c).get("type") == "Ready"), None)
    state = "Unknown" if ready is None else (
        "Ready" if ready.get("status") == "True" else "NotReady")
    if spec.get("unschedulable") is True:
        state += ",SchedulingDisabled"
    labels = _dict(_dict(obj.get("metadata")).get("labels"))
    roles = sorted(k.removeprefix("node-role.kubernetes.io/") for k in labels
                   if k.startswith("node-role.kubernetes.io/")
                   and k != "node-role.kubernetes.io/")
    info = _dict(status.get("nodeInfo"))

    def address(kind: str) -> str:
        return _or_none(next((_str(_dict(a).get("address")) for a in _list(
            status.get("addresses")) if _dict(a).get("type") == kind), ""))

    return [_name(obj), state, ",".join(roles) or NONE, age_of(obj),
            _str(info.get("kubeletVersion")), address("InternalIP"), address("ExternalIP"),
            _or_none(_str(info.get("osImage"))), _or_none(_str(info.get("kernelVersion"))),
            _or_none(_str(info.get("containerRuntimeVersion")))]


NODE = Printer([
    NAME_COL,
    col("Status", description="The status of the node"),
    col("Roles", description="The roles of the node"),
    AGE_COL,
    col("Version", description="Kubelet Version reported by the node."),
    col("Internal-IP", description="List of addresses reachable to the node.", priority=1),
    col("External-IP", description="List of addresses reachable to the node.", priority=1),
    col("OS-Image", description="OS Image reported by the node from /etc/os-release "
                                "(e.g. Debian GNU/Linux 7 (wheezy)).", priority=1),
    col("Kernel-Version", description="Kernel Version reported by the node from "
                                      "'uname -r' (e.g. 3.16.0-0.bpo.4-amd64).", priority=1),
    col("Container-Runtime", description="ContainerRuntime Version reported by the node "
                                         "through runtime remote API (e.g. "
                                         "containerd://1.4.2).", priority=1),
], _node_cells)


# --- events -------------------------------------------------------------------------


def _event_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    involved = _dict(obj.get("involvedObject"))
    last = _str(obj.get("lastTimestamp")) or _str(obj.get("eventTime"))
    first = _str(obj.get("firstTimestamp")) or last
    source = _dict(obj.get("source"))
    source_text = _str(source.get("component")) or _str(obj.get("reportingComponent"))
    if _str(source.get("host")):
        source_text += f", {source['host']}"
    count = _int(obj.get("count")) or 1
    return [age_of({"metadata": {"creationTimestamp": last}}) if last else NONE,
            _str(obj.get("type")), _str(obj.get("reason")),
            f"{_str(involved.get('kind')).lower()}/{_str(involved.get('name'))}",
            _str(involved.get("fieldPath")), source_text, _str(obj.get("message")).strip(),
            age_of({"metadata": {"creationTimestamp": first}}) if first else NONE,
            str(count), _name(obj)]


EVENT = Printer([
    col("Last Seen", description="The time at which the most recent occurrence of this "
                                 "event was recorded."),
    col("Type", description="Type of this event (Normal, Warning), new types could be added "
                            "in the future"),
    col("Reason", description="This should be a short, machine understandable string that "
                              "gives the reason for the transition into the object's "
                              "current status."),
    col("Object", description="The object that this event is about."),
    col("Subobject", description="If referring to a piece of an object instead of an entire "
                                 "object, this string should contain a valid JSON/Go field "
                                 "access statement.", priority=1),
    col("Source", description="The component reporting this event. Should be a short "
                              "machine understandable string.", priority=1),
    col("Message", description="A human-readable description of the status of this "
                               "operation."),
    col("First Seen", description="The time at which the event was first recorded. (Time "
                                  "of server receipt is in TypeMeta.)", priority=1),
    col("Count", description="The number of times this event has occurred.", priority=1),
    {**NAME_COL, "priority": 1},
], _event_cells)


# --- configmaps, namespaces ----------------------------------------------------------


def _configmap_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    return [_name(obj), len(_dict(obj.get("data"))) + len(_dict(obj.get("binaryData"))),
            age_of(obj)]


CONFIGMAP = Printer([
    NAME_COL,
    col("Data", description="Data contains the configuration data. Each key must consist of "
                            "alphanumeric characters, '-', '_' or '.'. Values with non-UTF-8 "
                            "byte sequences must use the BinaryData field. The keys stored in "
                            "Data must not overlap with the keys in the BinaryData field, this "
                            "is enforced during validation process."),
    AGE_COL,
], _configmap_cells)


def _secret_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    return [_name(obj), _str(obj.get("type")), len(_dict(obj.get("data"))), age_of(obj)]


SECRET = Printer([
    NAME_COL,
    col("Type", description="Used to facilitate programmatic handling of secret data. More "
                            "info: https://kubernetes.io/docs/concepts/configuration/secret/"
                            "#secret-types"),
    col("Data", description="Data contains the secret data. Each key must consist of "
                            "alphanumeric characters, '-', '_' or '.'. The serialized form of "
                            "the secret data is a base64 encoded string, representing the "
                            "arbitrary (possibly non-string) data value here. Described in "
                            "https://tools.ietf.org/html/rfc4648#section-4"),
    AGE_COL,
], _secret_cells)


def _lease_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    holder = _str(_dict(obj.get("spec")).get("holderIdentity"))
    return [_name(obj), holder, age_of(obj)]  # kube shows an empty holder as ""


LEASE = Printer([
    NAME_COL,
    col("Holder", description="holderIdentity contains the identity of the holder of a "
                              "current lease. If Coordinated Leader Election is used, the "
                              "holder identity must be equal to the elected "
                              "LeaseCandidate.metadata.name field."),
    AGE_COL,
], _lease_cells)


def _namespace_cells(obj: dict, age_of: Callable[[dict], str]) -> list[Any]:
    return [_name(obj), _str(_dict(obj.get("status")).get("phase")), age_of(obj)]


NAMESPACE = Printer([
    NAME_COL,
    col("Status", description="The status of the namespace"),
    AGE_COL,
], _namespace_cells)


DEFAULT = Printer([NAME_COL, AGE_COL], lambda obj, age_of: [_name(obj), age_of(obj)])

PRINTERS: dict[tuple[str, str], Printer] = {
    ("", "pods"): POD,
    ("apps", "deployments"): DEPLOYMENT,
    ("", "services"): SERVICE,
    ("", "nodes"): NODE,
    ("", "events"): EVENT,
    ("", "configmaps"): CONFIGMAP,
    ("", "namespaces"): NAMESPACE,
    ("", "secrets"): SECRET,
    ("apps", "statefulsets"): STATEFULSET,
    ("coordination.k8s.io", "leases"): LEASE,
}


def printer_for(group: str, resource: str) -> Printer:
    return PRINTERS.get((group, resource), DEFAULT)


__all__ = ["NONE", "PRINTERS", "Printer", "printer_for"]
