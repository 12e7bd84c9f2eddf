// Command coredns is CoreDNS with only the plugins a real node's Corefile uses (e2e/harness/nodes.py, corefile).
// CoreDNS's own main registers every plugin it ships; the cloud-provider, tracing and etcd plugins among them
// bring SDKs that are most of its compile.
package main

import (
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}
