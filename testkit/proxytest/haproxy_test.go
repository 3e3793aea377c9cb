package proxytest_test

import (
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/proxytest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// Round robin balances per connection: each new connection reaches the
// other standby, and the standby, not HAProxy, answers inet_server_port().
func TestHAProxyRoundRobinPerConnection(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(r...)})
	require.Equal(t, []string{"s1", "s2"}, []string{h.Server(0), h.Server(1)})

	ports := newConnectionPorts(ctx, t, dsnAt(h.Addr(), db), 6)
	for i := 1; i < len(ports); i++ {
		require.NotEqual(t, ports[i-1], ports[i], "consecutive new connections reach different standbys: %v", ports)
	}
	require.ElementsMatch(t, []int{r[0].Port(), r[1].Port()}, []int{ports[0], ports[1]}, "the standbys' own ports")
	require.NotContains(t, ports, h.Port())
}

// A server in maintenance gets no new connection, keeps its established
// ones, and is back in the rotation when ready.
func TestHAProxySetState(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(r...)})
	dsn := dsnAt(h.Addr(), db)
	// One established connection on each standby.
	a, b := connect(ctx, t, dsn), connect(ctx, t, dsn)
	pa, pb := serverPort(ctx, t, a), serverPort(ctx, t, b)
	require.ElementsMatch(t, []int{r[0].Port(), r[1].Port()}, []int{pa, pb})
	onS1 := a
	if pa != r[0].Port() {
		onS1 = b
	}

	require.NoError(t, h.SetState("s1", proxytest.Maint))
	for i, p := range newConnectionPorts(ctx, t, dsn, 4) {
		require.Equal(t, r[1].Port(), p, "new connection %d while s1 is in maintenance", i)
	}
	require.Equal(t, r[0].Port(), serverPort(ctx, t, onS1), "an established connection keeps its standby")

	require.NoError(t, h.SetState("s1", proxytest.Ready))
	require.ElementsMatch(t, []int{r[0].Port(), r[1].Port()}, newConnectionPorts(ctx, t, dsn, 2), "both in the rotation again")

	require.NoError(t, h.SetState("s2", proxytest.Drain))
	for i, p := range newConnectionPorts(ctx, t, dsn, 3) {
		require.Equal(t, r[0].Port(), p, "new connection %d while s2 drains", i)
	}

	err := h.SetState("s9", proxytest.Maint)
	require.Error(t, err)
	require.Contains(t, err.Error(), "No such server")
}

// Weight 0 takes a server out of the rotation; SetAddr moves one, as a
// DNS answer that changes under the balancer.
func TestHAProxySetWeightAndAddr(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	addrs := proxytest.Addrs(r...)
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: addrs})
	dsn := dsnAt(h.Addr(), db)

	require.NoError(t, h.SetWeight("s1", 0))
	for i, p := range newConnectionPorts(ctx, t, dsn, 3) {
		require.Equal(t, r[1].Port(), p, "new connection %d with s1 at weight 0", i)
	}
	require.NoError(t, h.SetWeight("s1", 1))
	require.ElementsMatch(t, []int{r[0].Port(), r[1].Port()}, newConnectionPorts(ctx, t, dsn, 2))

	// Both servers now lead to the second standby.
	require.NoError(t, h.SetAddr("s1", addrs[1]))
	for i, p := range newConnectionPorts(ctx, t, dsn, 4) {
		require.Equal(t, r[1].Port(), p, "new connection %d after s1 moved", i)
	}
	require.Equal(t, addrs, h.Backends(), "Backends are as configured")
	state, err := h.Command("show servers state be")
	require.NoError(t, err)
	require.Contains(t, state, " s1 127.0.0.1 ")
	require.Contains(t, state, " "+strings.Split(addrs[1], ":")[1]+" ", "s1's port is now the second standby's")
}

// ShutdownSessions ends the established connections through a server.
func TestHAProxyShutdownSessions(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(r...)})
	dsn := dsnAt(h.Addr(), db)
	a, b := connect(ctx, t, dsn), connect(ctx, t, dsn)
	onS1, onS2 := a, b
	if serverPort(ctx, t, a) != r[0].Port() {
		onS1, onS2 = b, a
	}
	require.NoError(t, h.ShutdownSessions("s1"))
	require.Eventually(t, func() bool {
		var one int
		return onS1.QueryRow(ctx, "SELECT 1").Scan(&one) != nil
	}, 5*time.Second, 10*time.Millisecond, "the connection through s1 is ended")
	require.Equal(t, r[1].Port(), serverPort(ctx, t, onS2), "the one through s2 is not")
}

// With health checks a server that refuses connections leaves the
// rotation by itself.
func TestHAProxyHealthCheck(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dead := ln.Addr().String()
	require.NoError(t, ln.Close())
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{
		Backends:      []string{proxytest.Addrs(r[0])[0], dead},
		CheckInterval: 50 * time.Millisecond,
	})
	require.Eventually(t, func() bool {
		out, err := h.Command("show servers state be")
		require.NoError(t, err)
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			// srv_name is field 4, srv_op_state field 6: 0 is stopped.
			if len(f) > 5 && f[3] == "s2" {
				return f[5] == "0"
			}
		}
		return false
	}, 10*time.Second, 20*time.Millisecond, "s2 marked down")
	for i, p := range newConnectionPorts(ctx, t, dsnAt(h.Addr(), db), 4) {
		require.Equal(t, r[0].Port(), p, "new connection %d with s2 down", i)
	}
}

// Close stops haproxy and removes its directory.
func TestHAProxyClose(t *testing.T) {
	t.Parallel()
	h, err := proxytest.NewHAProxy(t.Context(), proxytest.HAProxyConfig{Backends: []string{"127.0.0.1:1"}})
	require.NoError(t, err)
	pid, dir := h.PID(), h.Dir()
	require.Equal(t, []int{pid}, testsvc.ProcessesIn([]string{dir}), "haproxy runs in its sandbox, where the watchdog looks")
	require.NoError(t, h.Close())
	require.NoError(t, h.Close(), "idempotent")
	require.False(t, testsvc.Alive(pid))
	_, err = os.Stat(dir)
	require.True(t, os.IsNotExist(err), "%s removed: %v", dir, err)
	_, err = net.DialTimeout("tcp", h.Addr(), time.Second)
	require.Error(t, err)
}

func TestHAProxyConfigErrors(t *testing.T) {
	t.Parallel()
	_, err := proxytest.NewHAProxy(t.Context(), proxytest.HAProxyConfig{})
	require.ErrorContains(t, err, "Backends is empty")
	_, err = proxytest.NewHAProxy(t.Context(), proxytest.HAProxyConfig{Backends: []string{"not an address"}})
	require.ErrorContains(t, err, "exited during startup", "haproxy's own complaint, with its log")
}
