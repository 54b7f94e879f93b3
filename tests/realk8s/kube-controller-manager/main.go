// kube-controller-manager for mvproxy's real-Kubernetes tests: upstream's own main
// (k8s.io/kubernetes/cmd/kube-controller-manager/controller-manager.go), copied so
// the generated module imports its app package and `go mod tidy` keeps what it needs.
//
// Built by scripts/kube_binaries.py (python3 scripts/dev.py kube-binaries).
package main

import (
	"os"
	_ "time/tzdata" // for CronJob Time Zone support

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // for JSON log format registration
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // load all the prometheus client-go plugin
	_ "k8s.io/component-base/metrics/prometheus/version"  // for version metric registration
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	command := app.NewControllerManagerCommand()
	code := cli.Run(command)
	os.Exit(code)
}
