package redistest

import (
	"context"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// StandaloneOptions shape a single redis-server. The zero value runs it
// as the unprivileged service user when the test binary is root, like the
// Cluster's and the Sentinel set's servers.
type StandaloneOptions struct {
	// AsCaller runs redis-server as the test binary's own user, root
	// included, so that CONFIG SET may point it at files that only the
	// test can read (certificates in a t.TempDir, say). testkit/pgtest's
	// StartRedis does.
	AsCaller bool
	// Args are more redis-server arguments, after the harness's own, e.g.
	// {"--loglevel", "warning"}.
	Args []string
}

// Standalone is a throwaway redis-server on loopback without persistence:
// its Server (Addr, Port, Running, Start, Stop, Kill) in a sandbox of its
// own that Close (or the signal handler, or the sandbox's watchdog when
// the test binary dies) removes.
type Standalone struct {
	*Server
	d *deployment
}

// StartStandalone starts redis-server on a free loopback port and waits
// until it answers PING; a ctx without a deadline gets 30s.
func StartStandalone(ctx context.Context, opts StandaloneOptions) (*Standalone, error) {
	d, err := newDeployment("redistest-standalone-", opts.AsCaller)
	if err != nil {
		return nil, err
	}
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	s, err := d.add("redis", func(port int) []string { return append(baseArgs(port), opts.Args...) })
	if err == nil {
		err = s.firstStart(ctx)
	}
	if err != nil {
		_ = d.close()
		return nil, err
	}
	return &Standalone{Server: s, d: d}, nil
}

// Dir is the temporary directory Close removes; the server runs in its
// Server's Dir inside it.
func (s *Standalone) Dir() string { return s.d.sb.Root() }

// Close kills the server and removes its directory; idempotent.
func (s *Standalone) Close() error { return s.d.close() }
