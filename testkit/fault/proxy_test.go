package fault_test

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/fault"
)

// named serves a listener that answers every byte it reads with name, so
// a client can tell which server its connection reached.
func named(t *testing.T, name byte) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				b := make([]byte, 1)
				for {
					if _, err := c.Read(b); err != nil {
						return
					}
					if _, err := c.Write([]byte{name}); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func newProxy(t *testing.T, target string) *fault.Proxy {
	t.Helper()
	p, err := fault.NewProxy(target)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// refused fails t unless a new connection to addr ends at once: reset
// while connecting (the RST can beat connect's return) or on first use,
// never by a timeout.
func refused(t *testing.T, addr string) {
	t.Helper()
	began := time.Now()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err == nil {
		defer func() { _ = c.Close() }()
		_, err = server(c, 5*time.Second)
	}
	require.Error(t, err)
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "refused at once, not by a timeout: %v", err)
	require.Less(t, time.Since(began), 2*time.Second)
}

// server sends one byte and returns which server answered.
func server(c net.Conn, within time.Duration) (byte, error) {
	_ = c.SetDeadline(time.Now().Add(within))
	if _, err := c.Write([]byte("?")); err != nil {
		return 0, err
	}
	b := make([]byte, 1)
	_, err := io.ReadFull(c, b)
	return b[0], err
}

func TestProxySetTargetMovesNewConnectionsOnly(t *testing.T) {
	t.Parallel()
	a, b := named(t, 'a'), named(t, 'b')
	p := newProxy(t, a)
	old := dial(t, p.Addr())
	got, err := server(old, 2*time.Second)
	require.NoError(t, err)
	require.Equal(t, byte('a'), got)

	p.SetTarget(b)
	require.Equal(t, b, p.Target())
	got, err = server(dial(t, p.Addr()), 2*time.Second)
	require.NoError(t, err)
	require.Equal(t, byte('b'), got, "a new connection goes to the new target")
	got, err = server(old, 2*time.Second)
	require.NoError(t, err)
	require.Equal(t, byte('a'), got, "an established connection keeps its server")

	accepted, forwarding, held := p.Stats()
	require.Equal(t, 2, accepted)
	require.Equal(t, 2, forwarding)
	require.Zero(t, held)
}

func TestProxyRefuse(t *testing.T) {
	t.Parallel()
	p := newProxy(t, named(t, 'a'))
	live := dial(t, p.Addr())
	_, err := server(live, 2*time.Second)
	require.NoError(t, err)

	p.Refuse()
	refused(t, p.Addr())
	_, err = server(live, 2*time.Second)
	require.NoError(t, err, "live connections keep working while new ones are refused")

	p.Accept()
	_, err = server(dial(t, p.Addr()), 2*time.Second)
	require.NoError(t, err, "accepted again")
}

func TestProxyBlackhole(t *testing.T) {
	t.Parallel()
	p := newProxy(t, named(t, 'a'))
	live := dial(t, p.Addr())
	_, err := server(live, 2*time.Second)
	require.NoError(t, err)

	p.Blackhole()
	held := dial(t, p.Addr())
	_, err = server(held, 200*time.Millisecond)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "a blackholed connection hangs")
	require.Eventually(t, func() bool { _, _, h := p.Stats(); return h == 1 }, 2*time.Second, time.Millisecond)
	_, err = server(live, 2*time.Second)
	require.NoError(t, err, "live connections keep working in a blackhole")

	// Released, the held connection reaches its server with the byte it
	// sent while held.
	p.Accept()
	_ = held.SetDeadline(time.Now().Add(2 * time.Second))
	b := make([]byte, 1)
	_, err = io.ReadFull(held, b)
	require.NoError(t, err)
	require.Equal(t, byte('a'), b[0])

	// Refuse ends what a blackhole holds.
	p.Blackhole()
	held2 := dial(t, p.Addr())
	require.Eventually(t, func() bool { _, _, h := p.Stats(); return h == 1 }, 2*time.Second, time.Millisecond)
	p.Refuse()
	_, err = server(held2, 2*time.Second)
	require.Error(t, err)
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "reset, not left hanging: %v", err)
}

func TestProxyCut(t *testing.T) {
	t.Parallel()
	p := newProxy(t, named(t, 'a'))
	live := dial(t, p.Addr())
	_, err := server(live, 2*time.Second)
	require.NoError(t, err)
	require.Equal(t, 1, p.Cut())
	_, err = server(live, 2*time.Second)
	require.Error(t, err)
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "cut, not hanging: %v", err)
	_, err = server(dial(t, p.Addr()), 2*time.Second)
	require.NoError(t, err, "Cut does not refuse new connections")
}

// A target that is down resets the client at once, as a balancer whose
// server is gone does.
func TestProxyTargetDown(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	down := ln.Addr().String()
	require.NoError(t, ln.Close())
	refused(t, newProxy(t, down).Addr())
}

func TestProxyClose(t *testing.T) {
	t.Parallel()
	p, err := fault.NewProxy(named(t, 'a'))
	require.NoError(t, err)
	live := dial(t, p.Addr())
	_, err = server(live, 2*time.Second)
	require.NoError(t, err)
	p.Blackhole()
	held := dial(t, p.Addr())
	require.Eventually(t, func() bool { _, _, h := p.Stats(); return h == 1 }, 2*time.Second, time.Millisecond)

	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "idempotent")
	for _, c := range []net.Conn{live, held} {
		_, err = server(c, 2*time.Second)
		require.Error(t, err)
		require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "closed, not hanging: %v", err)
	}
	_, err = net.DialTimeout("tcp", p.Addr(), time.Second)
	require.Error(t, err, "no longer listening")
}

// ListenProxy binds the address it is given, so that several proxies can
// share a port on different loopback addresses.
func TestListenProxySharedPort(t *testing.T) {
	t.Parallel()
	p1, err := fault.ListenProxy("127.0.0.1:0", named(t, 'a'))
	require.NoError(t, err)
	t.Cleanup(func() { _ = p1.Close() })
	_, port, err := net.SplitHostPort(p1.Addr())
	require.NoError(t, err)
	p2, err := fault.ListenProxy(net.JoinHostPort("127.0.0.2", port), named(t, 'b'))
	require.NoError(t, err)
	t.Cleanup(func() { _ = p2.Close() })
	require.Equal(t, "127.0.0.2:"+port, p2.Addr())
	for addr, want := range map[string]byte{p1.Addr(): 'a', p2.Addr(): 'b'} {
		got, err := server(dial(t, addr), 2*time.Second)
		require.NoError(t, err)
		require.Equal(t, want, got, addr)
	}
}
