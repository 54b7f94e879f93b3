// etcd for mvproxy's real-Kubernetes tests: runs etcdmain with the process's
// arguments. `go install go.etcd.io/etcd/server/v3@v3.6.z` is refused (its
// go.mod has replace directives), so a generated module requires it instead.
//
// Built by scripts/kube_binaries.py (python3 scripts/dev.py kube-binaries).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
