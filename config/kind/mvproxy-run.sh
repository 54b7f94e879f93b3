#!/bin/sh
# Starts mvproxy on a kind control-plane node with what differs per node: mvproxy.service
# runs it (docs/kind.md). The node's name is its hostname (kind names the container
# and the Kubernetes node alike, and kubeadm puts that name in apiserver.crt); its IP is
# the IPv4 address Docker gives that name in /etc/hosts, the one kind passes to kubelet
# as --node-ip and kube-apiserver advertises in the default/kubernetes Service.
set -eu
MVPROXY=${MVPROXY:-/opt/mvproxy/dist/mvproxy}
NODE_NAME=$(hostname)
# shellcheck disable=SC2046  # split getent's answer into words: the address is the first
set -- $(getent ahostsv4 "$NODE_NAME" || true)
if [ "$#" -eq 0 ]; then
    echo "mvproxy-run.sh: no IPv4 address for $NODE_NAME in /etc/hosts" >&2
    exit 1
fi
HOST_IP=$1
exec "$MVPROXY" run \
    --config=/etc/kubernetes/mvproxy/config.yaml \
    --server-id="$NODE_NAME" \
    --bind-address="$HOST_IP" \
    --secure-port=6443 \
    --backend-url=https://127.0.0.1:6443 \
    --peer-advertise-url="https://$HOST_IP:6443" \
    --admin-bind-address=127.0.0.1 \
    --admin-port=9443
