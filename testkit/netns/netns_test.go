package netns_test

import (
	"bufio"
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/netns"
)

// echoServer listens on the root namespace's loopback and answers each
// line with the line; it counts the lines it read and records the remote
// addresses it saw.
type echoServer struct {
	ln    net.Listener
	lines atomic.Int64
	peers chan string
}

func startEcho(t *testing.T) *echoServer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &echoServer{ln: ln, peers: make(chan string, 64)}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			select {
			case s.peers <- c.RemoteAddr().String():
			default:
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					s.lines.Add(1)
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return s
}

func (s *echoServer) port() int { return s.ln.Addr().(*net.TCPAddr).Port }

func newNamespace(t *testing.T, role string) *netns.Namespace {
	ns, err := netns.New(role)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, ns.Close()) })
	return ns
}

// roundTrip writes a line and reads it back within d.
func roundTrip(c net.Conn, d time.Duration) error {
	if err := c.SetDeadline(time.Now().Add(d)); err != nil {
		return err
	}
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "ping\n" {
		return errors.New("echo answered " + line)
	}
	return nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func dial(ns *netns.Namespace, addr string, d time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return ns.DialContext(ctx, "tcp", addr)
}

func TestMain(m *testing.M) {
	if err := netns.Check(); err != nil {
		// Never a silent skip: a host without namespaces fails, saying so.
		println(err.Error())
		os.Exit(1)
	}
	os.Exit(m.Run())
}

func TestDialReachesRootLoopbackAsLoopback(t *testing.T) {
	srv := startEcho(t)
	ns := newNamespace(t, "dial")
	c, err := dial(ns, srv.ln.Addr().String(), 2*time.Second)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, roundTrip(c, 2*time.Second))
	peer := <-srv.peers
	require.True(t, strings.HasPrefix(peer, "127.0.0.1:"), "the server sees a loopback peer, for loopback-only access rules: %s", peer)
	require.True(t, strings.HasPrefix(c.LocalAddr().String(), strings.TrimSuffix(ns.HostIP(), "1")+"2:"),
		"the connection is the namespace's (%s), not the root's", c.LocalAddr())
}

func TestBlockDropsInsteadOfRefusing(t *testing.T) {
	srv := startEcho(t)
	ns := newNamespace(t, "block")
	open, err := dial(ns, srv.ln.Addr().String(), 2*time.Second)
	require.NoError(t, err)
	defer open.Close()
	require.NoError(t, roundTrip(open, 2*time.Second))

	heal, err := ns.Block(srv.port(), netns.Both)
	require.NoError(t, err)
	err = roundTrip(open, 500*time.Millisecond)
	require.True(t, isTimeout(err), "an open connection hangs: %v", err)
	_, err = dial(ns, srv.ln.Addr().String(), 500*time.Millisecond)
	require.Error(t, err)
	require.False(t, errors.Is(err, syscallECONNREFUSED()), "a new dial is dropped, not refused: %v", err)

	// The root namespace's own clients are not partitioned.
	rc, err := net.DialTimeout("tcp", srv.ln.Addr().String(), time.Second)
	require.NoError(t, err)
	require.NoError(t, roundTrip(rc, time.Second))
	_ = rc.Close()

	require.NoError(t, heal())
	c, err := dial(ns, srv.ln.Addr().String(), 2*time.Second)
	require.NoError(t, err, "healed: dials pass again")
	require.NoError(t, roundTrip(c, 2*time.Second))
	_ = c.Close()
}

func TestBlockInOnlyLetsRequestsArrive(t *testing.T) {
	srv := startEcho(t)
	ns := newNamespace(t, "asym")
	c, err := dial(ns, srv.ln.Addr().String(), 2*time.Second)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, roundTrip(c, 2*time.Second))
	before := srv.lines.Load()

	heal, err := ns.Block(srv.port(), netns.In)
	require.NoError(t, err)
	defer heal()
	err = roundTrip(c, 500*time.Millisecond)
	require.True(t, isTimeout(err), "no answer comes back: %v", err)
	require.Eventually(t, func() bool { return srv.lines.Load() > before }, 2*time.Second, 10*time.Millisecond,
		"the request reached the server: one way only")
}

func TestLoseAndHeal(t *testing.T) {
	srv := startEcho(t)
	ns := newNamespace(t, "loss")
	_, err := ns.Lose(srv.port(), 100)
	require.NoError(t, err)
	_, err = dial(ns, srv.ln.Addr().String(), 500*time.Millisecond)
	require.Error(t, err, "all packets lost: no connection")
	_, err = ns.Block(srv.port(), netns.Out)
	require.NoError(t, err)

	require.NoError(t, ns.Heal(), "Heal removes every Block and Lose")
	c, err := dial(ns, srv.ln.Addr().String(), 2*time.Second)
	require.NoError(t, err)
	require.NoError(t, roundTrip(c, 2*time.Second))
	_ = c.Close()

	_, err = ns.Lose(srv.port(), 0)
	require.Error(t, err)
}

func TestAddrAndCommand(t *testing.T) {
	ns := newNamespace(t, "cmd")
	require.Equal(t, "postgres://postgres@"+ns.HostIP()+":5432/db?sslmode=disable",
		ns.Addr("postgres://postgres@127.0.0.1:5432/db?sslmode=disable"))
	require.Equal(t, ns.HostIP()+":6379", ns.Addr("127.0.0.1:6379"))
	require.Equal(t, "x=redis://"+ns.HostIP()+":1/0", ns.Addr("x=redis://localhost:1/0"))
	require.Equal(t, "10.0.0.1:5432", ns.Addr("10.0.0.1:5432"))

	out, err := ns.Command("ip", "-o", "-4", "addr", "show").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), strings.TrimSuffix(ns.HostIP(), "1")+"2/30", "the command runs inside")
}

func TestCloseRemovesEverything(t *testing.T) {
	ns, err := netns.New("gone")
	require.NoError(t, err)
	name := ns.Name()
	require.NoError(t, ns.Close())
	_, err = os.Stat("/run/netns/" + name)
	require.True(t, os.IsNotExist(err), "the namespace is gone: %v", err)
	_, err = ns.DialContext(context.Background(), "tcp", "127.0.0.1:1")
	require.Error(t, err)
	require.NoError(t, ns.Close(), "a second Close is a no-op")
}

func syscallECONNREFUSED() error { return syscall.ECONNREFUSED }

func TestDelayHoldsPacketsEachWay(t *testing.T) {
	srv := startEcho(t)
	ns := newNamespace(t, "delay")
	c, err := dial(ns, srv.ln.Addr().String(), 2*time.Second)
	require.NoError(t, err)
	defer c.Close()
	timed := func() time.Duration {
		began := time.Now()
		require.NoError(t, roundTrip(c, 5*time.Second))
		return time.Since(began)
	}
	require.Less(t, timed(), 100*time.Millisecond, "no delay yet")

	heal, err := ns.Delay(srv.port(), 100*time.Millisecond, 20*time.Millisecond)
	require.NoError(t, err)
	// A round trip is a packet out and one back (the ACK of the request
	// rides on the answer or is not waited for): about twice the delay.
	for range 3 {
		d := timed()
		require.GreaterOrEqual(t, d, 160*time.Millisecond, "each way held 80–120ms")
		require.Less(t, d, 2*time.Second)
	}
	// Other ports are not delayed.
	other := startEcho(t)
	oc, err := dial(ns, other.ln.Addr().String(), 2*time.Second)
	require.NoError(t, err)
	began := time.Now()
	require.NoError(t, roundTrip(oc, 2*time.Second))
	require.Less(t, time.Since(began), 100*time.Millisecond)
	_ = oc.Close()

	require.NoError(t, heal())
	require.Less(t, timed(), 100*time.Millisecond, "healed")
	_, err = ns.Delay(srv.port(), time.Millisecond, 2*time.Millisecond)
	require.Error(t, err, "jitter over the delay")
}
