// kube-controller-manager for mvproxy's real-Kubernetes tests. A main of our own
// that runs the app package's command: the generated module then imports that
// package, and `go mod tidy` keeps what it needs. The blank imports register what
// the released binary has (embedded time zones, JSON logs, client-go and build-info
// metrics), so the test binary behaves like the released one.
//
// Built by scripts/kube_binaries.py (python3 scripts/dev.py kube-binaries).
package main

import (
	"os"
	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	command := app.NewControllerManagerCommand()
	code := cli.Run(command)
	os.Exit(code)
}
