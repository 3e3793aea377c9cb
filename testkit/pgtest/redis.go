package pgtest

import (
	"context"

	"github.com/caughtup/caughtup/testkit/redistest"
)

// Redis is a throwaway redis-server without persistence: a
// redistest.Standalone that runs as the test binary's own user, root
// included (unlike PostgreSQL), so that a test may CONFIG SET it to files
// only the test can read, as feed's TestTLS does with its certificates.
type Redis struct {
	s *redistest.Standalone
}

// StartRedis starts redis-server on a free loopback port.
func StartRedis(ctx context.Context) (*Redis, error) {
	s, err := redistest.StartStandalone(ctx, redistest.StandaloneOptions{
		AsCaller: true,
		Args:     []string{"--loglevel", "warning"},
	})
	if err != nil {
		return nil, err
	}
	return &Redis{s: s}, nil
}

// Addr is host:port for go-redis / asynq.
func (r *Redis) Addr() string { return r.s.Addr() }

// Dir is the temporary directory Close removes; redis-server runs in it.
func (r *Redis) Dir() string { return r.s.Dir() }

// Port is the loopback TCP port; it survives Stop/Kill and Start.
func (r *Redis) Port() int { return r.s.Port() }

// Running reports whether redis-server is alive.
func (r *Redis) Running() bool { return r.s.Running() }

// Start restarts a stopped or killed server on the same port. The data is
// gone: persistence is off.
func (r *Redis) Start(ctx context.Context) error { return r.s.Start(ctx) }

// Stop shuts redis-server down with SIGTERM and waits.
func (r *Redis) Stop() error { return r.s.Stop() }

// Kill SIGKILLs redis-server and waits.
func (r *Redis) Kill() error { return r.s.Kill() }

// Close kills the server and removes its temp dir; idempotent.
func (r *Redis) Close() error { return r.s.Close() }
