package proxytest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// HAProxyConfig configures an HAProxy in `mode tcp` with `balance
// roundrobin`: every new client connection goes to the next server, the
// way a Kubernetes Service, an LVS virtual IP or a cloud reader endpoint
// spreads the connections of one pool over several replicas.
type HAProxyConfig struct {
	// Backends are the servers, as host:port, named s1, s2, … in this order
	// (the names SetState and SetWeight take). Required.
	Backends []string
	// CheckInterval turns on HAProxy's TCP health checks at this interval:
	// a server that refuses three checks in a row leaves the rotation until
	// two succeed. Default: 0, no checks, so a server stays in the rotation
	// until SetState takes it out, whatever it does: a test decides when the
	// balancer's choice moves rather than racing a check.
	CheckInterval time.Duration
}

// ServerState is an administrative state of an HAProxy server.
type ServerState string

const (
	// Ready puts a server back into the rotation.
	Ready ServerState = "ready"
	// Drain takes it out of the rotation for new connections; its
	// established connections stay.
	Drain ServerState = "drain"
	// Maint takes it out of the rotation and stops its health checks; its
	// established connections stay (ShutdownSessions ends them).
	Maint ServerState = "maint"
)

// backend is the one backend's name in the configuration.
const backend = "be"

// HAProxy is a running haproxy.
type HAProxy struct {
	*service
	backends []string
}

// StartHAProxy starts an HAProxy for t and stops it when t ends. It fails
// t, never skips it, when haproxy cannot start.
func StartHAProxy(t testing.TB, cfg HAProxyConfig) *HAProxy {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, err := NewHAProxy(ctx, cfg)
	if err != nil {
		t.Fatalf("proxytest: %v", err)
	}
	t.Cleanup(func() {
		if err := h.Close(); err != nil {
			t.Errorf("proxytest: %v", err)
		}
	})
	return h
}

// NewHAProxy starts an HAProxy on a free loopback port; the caller closes
// it. StartHAProxy is the form for tests.
func NewHAProxy(ctx context.Context, cfg HAProxyConfig) (*HAProxy, error) {
	if len(cfg.Backends) == 0 {
		return nil, errors.New("proxytest: HAProxyConfig.Backends is empty")
	}
	bin, ok := testsvc.FindBinary("HAPROXY", "haproxy", "/usr/sbin/haproxy")
	if !ok {
		return nil, errors.New("proxytest: haproxy not found ($HAPROXY, $PATH, /usr/sbin); is haproxy installed? run scripts/install-deps")
	}
	h := &HAProxy{backends: append([]string(nil), cfg.Backends...)}
	s, err := startService(ctx, spec{
		name: "haproxy",
		bin:  bin,
		files: func(dir string, port int) (map[string]string, []string) {
			// -db: foreground, no daemon, so the process we started is the
			// one that serves and its exit is ours to see.
			return map[string]string{"haproxy.cfg": haproxyConf(dir, port, cfg)},
				[]string{"-db", "-f", filepath.Join(dir, "haproxy.cfg")}
		},
		ready: func(ctx context.Context, s *service) error {
			// The listeners are bound before the runtime API answers, and
			// a bind failure ends the process instead.
			out, err := runtimeCommand(ctx, socketPath(s.dir), "show info")
			if err == nil && !strings.Contains(out, "Name: HAProxy") {
				err = fmt.Errorf("show info said %q", out)
			}
			return err
		},
	})
	if err != nil {
		return nil, err
	}
	h.service = s
	return h, nil
}

func socketPath(dir string) string { return filepath.Join(dir, "admin.sock") }

func haproxyConf(dir string, port int, cfg HAProxyConfig) string {
	var b strings.Builder
	fmt.Fprintf(&b, `# Written by proxytest.
global
	# State changes and startup problems, on stderr, which is the log file.
	log stderr format raw local0 notice
	# The runtime API: SetState, SetWeight, SetAddr, Command.
	stats socket %s mode 600 level admin
	# HAProxy sizes its buffers by maxconn, which defaults to the fd limit.
	maxconn 1000

defaults
	mode tcp
	log global
	timeout connect 5s
	# Long enough that no test sees an idle pool connection cut.
	timeout client 1h
	timeout server 1h

frontend fe
	bind 127.0.0.1:%d
	default_backend %s

backend %s
	balance roundrobin
`, socketPath(dir), port, backend, backend)
	check := ""
	if cfg.CheckInterval > 0 {
		check = fmt.Sprintf(" check inter %dms fall 3 rise 2", max(cfg.CheckInterval.Milliseconds(), 1))
	}
	for i, addr := range cfg.Backends {
		fmt.Fprintf(&b, "\tserver s%d %s%s\n", i+1, addr, check)
	}
	return b.String()
}

// Server is the name of the i-th backend (from 0), "s1" for the first.
func (h *HAProxy) Server(i int) string { return "s" + strconv.Itoa(i+1) }

// Backends are the servers' addresses as configured, in order; SetAddr
// does not change them.
func (h *HAProxy) Backends() []string { return append([]string(nil), h.backends...) }

// SetState changes a server's administrative state (`set server be/s1
// state maint`). Established connections are not touched.
func (h *HAProxy) SetState(server string, state ServerState) error {
	return h.set(server, "state "+string(state))
}

// SetWeight sets a server's weight (0 to 256; 0 takes it out of the
// rotation for new connections). Every server starts at 1.
func (h *HAProxy) SetWeight(server string, weight int) error {
	return h.set(server, "weight "+strconv.Itoa(weight))
}

// SetAddr points a server at another host:port, as a DNS answer that
// changes under a balancer does; new connections to it go there.
func (h *HAProxy) SetAddr(server, addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("proxytest: SetAddr %s: %w", server, err)
	}
	// It answers with what changed ("IP changed from …", "no need to change
	// the addr, port changed from …") when it works.
	return h.ok("set server "+backend+"/"+server+" addr "+host+" port "+port, "changed from")
}

// ShutdownSessions ends every established connection through server.
func (h *HAProxy) ShutdownSessions(server string) error {
	return h.ok("shutdown sessions server " + backend + "/" + server)
}

func (h *HAProxy) set(server, what string) error {
	return h.ok("set server " + backend + "/" + server + " " + what)
}

// ok runs a command that answers nothing when it works, or else something
// containing success.
func (h *HAProxy) ok(cmd string, success ...string) error {
	out, err := h.Command(cmd)
	if err != nil {
		return err
	}
	if out = strings.TrimSpace(out); out != "" && (len(success) == 0 || !strings.Contains(out, success[0])) {
		return fmt.Errorf("proxytest: haproxy: %s: %s", cmd, out)
	}
	return nil
}

// Command runs one command on HAProxy's runtime API (`show servers state
// be`, `disable server be/s1`, …; see HAProxy's management guide) and
// returns its answer.
func (h *HAProxy) Command(cmd string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out, err := runtimeCommand(ctx, socketPath(h.dir), cmd)
	if err != nil {
		return "", fmt.Errorf("proxytest: haproxy: %s: %w", cmd, err)
	}
	return out, nil
}

// runtimeCommand sends one command; without `prompt`, HAProxy answers and
// closes the connection, so the answer is everything up to EOF.
func runtimeCommand(ctx context.Context, sock, cmd string) (string, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return "", err
	}
	defer func() { _ = c.Close() }()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	if _, err := io.WriteString(c, cmd+"\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}
