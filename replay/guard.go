package replay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/internal/pgwal"
)

// ErrReplicaBehind is wrapped by the error a Guard returns for a
// new connection to a replica that, after a restart, has not replayed
// what the tracker saw it replay before within GuardConfig.HoldTimeout.
// pgxpool returns it from Acquire (and so from the handler's query): the
// job fails without reading anything and is retried by the queue.
var ErrReplicaBehind = errors.New("caughtup/replay: the replica shows less than the tracker saw it replay (it restarted); connection refused")

// GuardConfig configures a Guard.
type GuardConfig struct {
	// HoldTimeout is how long a new connection waits for its replica to
	// replay what the tracker had seen before the connection is refused
	// (ErrReplicaBehind). Default 2s: a restarted standby replays the WAL
	// it had already received at hundreds of MB/s, so it normally catches
	// up well within it; one that cannot (its upstream gone, replay paused)
	// fails the job quickly instead of holding a worker, and the queue
	// retries it.
	HoldTimeout time.Duration
	// RecheckInterval is how often a held connection asks its replica
	// again. Default 5ms, the default WaitPollInterval: a held connection
	// costs its replica at most 200 queries/s, and only after a restart.
	RecheckInterval time.Duration
}

// Defaults for GuardConfig.
const (
	DefaultGuardHoldTimeout     = 2 * time.Second
	DefaultGuardRecheckInterval = 5 * time.Millisecond
)

// WithDefaults returns c with every zero field set to its default.
func (c GuardConfig) WithDefaults() GuardConfig {
	if c.HoldTimeout == 0 {
		c.HoldTimeout = DefaultGuardHoldTimeout
	}
	if c.RecheckInterval == 0 {
		c.RecheckInterval = DefaultGuardRecheckInterval
	}
	return c
}

// Validate checks a config after WithDefaults.
func (c GuardConfig) Validate() error {
	if c.HoldTimeout < 0 || c.RecheckInterval <= 0 {
		return fmt.Errorf("%w: GuardConfig durations must be positive (zero means the default)", ErrInvalidConfig)
	}
	return nil
}

// Guard closes the replica restart window: a replica restarted
// after a job was routed to it, and before the handler read, accepts
// connections at its minimum recovery point, which can be below what it
// had replayed when the job was routed (design fact 9), and the handler
// would read stale rows without any error.
//
// Install it on the config of a replica's pool before the pool is built,
// and give it to the Router with that replica (Replica.Guard). Every new
// connection of the pool is then held, before the pool hands it out, until
//
//   - the tracker has seen the replica's current run (Incarnation), so
//     that no observation from before a restart can be used after the
//     connection is admitted (the tracker ignores those, see
//     ReplicaObservation), and
//   - the replica has replayed at least ReplicaState.HighestReplayed, the
//     highest position the tracker ever saw it at, which no decision's
//     ReadAt exceeds,
//
// or refused with ErrReplicaBehind after HoldTimeout. Connections opened
// before a restart die with it (their queries fail), so every read a
// routed handler makes on the pool sees at least what its decision
// assumed. The check costs one query per new connection and nothing per
// job; the tracker's own connections are not held.
//
// It relies on connections going straight to the replica (or through a
// session-mode pooler that ties a client connection to one server
// session): a transaction-mode pooler may move a client connection to a
// new server session after a restart without the pool reconnecting, and
// the guard would not see it. Only routed handlers should use a guarded
// pool: it holds connections while the tracker has not observed the
// replica.
type Guard struct {
	cfg       GuardConfig
	installed atomic.Bool

	mu sync.Mutex
	t  *Tracker
	p  *replicaPoller
}

// NewGuard returns a guard for one replica's pool.
func NewGuard(cfg GuardConfig) (*Guard, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Guard{cfg: cfg}, nil
}

// Install makes every new connection of the pool built from cfg pass the
// guard, after cfg's own AfterConnect (if any) has run. Call it after
// setting up cfg and before pgxpool.NewWithConfig.
func (g *Guard) Install(cfg *pgxpool.Config) {
	prev := cfg.AfterConnect
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		if prev != nil {
			if err := prev(ctx, conn); err != nil {
				return err
			}
		}
		return g.check(ctx, conn)
	}
	g.installed.Store(true)
}

// adopt attaches the guard to a Router's tracker.
func (g *Guard) adopt(t *Tracker, p *replicaPoller) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.t != nil {
		return errors.New("the Guard already serves another running Router; give each Router its own guard and pool")
	}
	g.t, g.p = t, p
	return nil
}

func (g *Guard) release(t *Tracker) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.t == t {
		g.t, g.p = nil, nil
	}
}

func (g *Guard) source() (*Tracker, *replicaPoller) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.t, g.p
}

// admit is the guard's rule: a connection to a server in recovery is
// admitted once the tracker's state is of the connection's run (or a
// newer one) and the connection has replayed HighestReplayed. A server
// out of recovery holds everything it ever replayed.
func admit(r pgwal.Replica, st *ReplicaState) bool {
	if !r.InRecovery {
		return true
	}
	if st.Observations == 0 || st.Incarnation.IsZero() || st.Incarnation.Compare(incarnationOf(r)) < 0 {
		return false
	}
	return r.LSN >= st.HighestReplayed
}

func (g *Guard) check(ctx context.Context, conn *pgx.Conn) error {
	if ctx.Value(trackerConnKey{}) != nil {
		return nil
	}
	t, p := g.source()
	if t == nil {
		return nil // no Router: no decision to protect
	}
	deadline := time.Now().Add(g.cfg.HoldTimeout)
	var timer *time.Timer
	var stopWatch func()
	defer func() {
		if timer != nil {
			timer.Stop()
		}
		if stopWatch != nil {
			stopWatch()
		}
	}()
	for {
		r, err := pgwal.ReadReplica(ctx, conn, pgwal.Status)
		if err != nil {
			return fmt.Errorf("caughtup/replay: Guard for replica %q: %w", p.name, err)
		}
		st := t.snapshot().Databases[p.db].Replicas[p.idx]
		if admit(r, &st) {
			if stopWatch != nil {
				t.met.guardResult(p.db, p.idx, false)
			}
			return nil
		}
		if stopWatch == nil {
			// While a connection is held the tracker polls the replica
			// every WaitPollInterval, as for a waiting job.
			stopWatch = t.watch(p.db, []int{p.idx})
		}
		if !time.Now().Before(deadline) {
			t.met.guardResult(p.db, p.idx, true)
			t.log.Warn("caughtup: Guard refused a connection: the replica shows less than it was seen to replay (it restarted)",
				"caughtup.database", p.dbName, attrReplica, p.name, "replayed", r.LSN.String(), "highest_seen", st.HighestReplayed.String())
			return fmt.Errorf("%w: replica %q has replayed %v, the tracker saw %v; held %v", ErrReplicaBehind, p.name, r.LSN, st.HighestReplayed, g.cfg.HoldTimeout)
		}
		if timer == nil {
			timer = time.NewTimer(g.cfg.RecheckInterval)
		} else {
			timer.Reset(g.cfg.RecheckInterval)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-timer.C:
		}
	}
}
