package enqueue

import (
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/internal/weakkey"
)

// sysIDCache remembers what each connection's server says about itself in
// its control file (system identifier, WAL layout) so that
// pg_control_system() and pg_control_init(), which read that file, run once
// per connection and refresh period rather than on every capture.
//
// It is keyed by the connection itself through a weak pointer (weakkey): a
// new connection (to whatever server) always starts with a read, a pooled
// connection's entry lives as long as the connection, and the entry is
// dropped when the garbage collector frees the connection, so the map is
// bounded by the number of live connections without any bookkeeping by the
// caller. Keying by server address or backend PID instead would let a
// restored or re-initialised cluster on the same address inherit the old
// identifier, and PIDs are reused.
type sysIDCache struct {
	m weakkey.Map[pgconn.PgConn, sysIDEntry]
}

type sysIDEntry struct {
	ctl    pgwal.ControlFile
	readAt time.Time
}

// get returns what was read on pc if it was read less than ttl ago.
func (c *sysIDCache) get(pc *pgconn.PgConn, now time.Time, ttl time.Duration) (pgwal.ControlFile, bool) {
	if ttl <= 0 {
		return pgwal.ControlFile{}, false
	}
	e, ok := c.m.Load(pc)
	// A clock that steps backwards also forces a read.
	if !ok || now.Before(e.readAt) || now.Sub(e.readAt) >= ttl {
		return pgwal.ControlFile{}, false
	}
	return e.ctl, true
}

func (c *sysIDCache) put(pc *pgconn.PgConn, ctl pgwal.ControlFile, now time.Time) {
	c.m.Store(pc, sysIDEntry{ctl: ctl, readAt: now})
}

func (c *sysIDCache) len() int { return c.m.Len() }
