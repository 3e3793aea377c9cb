package proxytest

import (
	"net"
	"strconv"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Addrs are the nodes' host:port, for HAProxyConfig.Backends and
// PgBouncerConfig.Backends.
func Addrs(nodes ...*pgtest.Node) []string {
	addrs := make([]string, len(nodes))
	for i, n := range nodes {
		addrs[i] = net.JoinHostPort("127.0.0.1", strconv.Itoa(n.Port()))
	}
	return addrs
}
