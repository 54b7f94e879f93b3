// kube-apiserver for mvproxy's real-Kubernetes tests: runs the app package's command,
// with the blank imports the released binary has (embedded time zones, JSON logs,
// client-go and build-info metrics), plus a hostname override.
//
// The server ID, and with it the identity Lease name, is a hash of the hostname
// only, so two servers on one host collide. `--mvproxy-hostname NAME` (removed
// before upstream's flags are parsed) or MVPROXY_KUBE_HOSTNAME gives each its own,
// as upstream's peer-proxy integration test does with SetHostnameFuncForTests.
//
// Built by scripts/kube_binaries.py (python3 scripts/dev.py kube-binaries); not a
// module here: the go.mod is generated per Kubernetes version in the cache.
package main

import (
	"os"
	"strings"
	_ "time/tzdata"

	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

const hostnameFlag = "--mvproxy-hostname"

// splitHostname returns the hostname asked for (flag first, then the environment)
// and the arguments without the flag.
func splitHostname(args []string) (string, []string) {
	hostname := os.Getenv("MVPROXY_KUBE_HOSTNAME")
	rest := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		arg := args[i]
		switch {
		case arg == hostnameFlag && i+1 < len(args):
			hostname = args[i+1]
			i++
		case strings.HasPrefix(arg, hostnameFlag+"="):
			hostname = strings.TrimPrefix(arg, hostnameFlag+"=")
		default:
			rest = append(rest, arg)
		}
	}
	return hostname, rest
}

func main() {
	hostname, args := splitHostname(os.Args[1:])
	if hostname != "" {
		genericapiserver.SetHostnameFuncForTests(hostname)
	}
	command := app.NewAPIServerCommand()
	command.SetArgs(args)
	code := cli.Run(command)
	os.Exit(code)
}
