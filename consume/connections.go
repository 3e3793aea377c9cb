package consume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/multitracer"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// Each handler connection is tied to the server the decision judged.
//
// A replica "pool" may reach more than one server: a load balancer, a
// Kubernetes Service, a multi-host DSN, PgBouncer over several standbys,
// a DNS name that moves, a failover behind a virtual IP. What the tracker
// saw on its own connection then says nothing about the connection a
// handler gets. So the Router hands its handlers pools of its own, built
// from each replica pool's config (hooks, TLS and credentials included),
// in which every new connection records the run of the server it reached
// (replay.Incarnation: postmaster and startup process start, and the
// system identifier), and every acquire by a routed handler checks that
// connection against the decision in the handler's context:
//
//   - the connection's server run is the one the decision judged
//     (DatabaseDecision's replica, as the tracker last saw it): admitted,
//     with no query (a pool that reaches one server pays nothing per job);
//   - another run (another server, or the same one restarted since): one
//     query on that connection, which is admitted only if its server has
//     replayed the token's position and what the decision promised
//     children (ReadAt), in a history they belong to;
//   - otherwise the connection is dropped and pgxpool hands out another
//     (a balancer sends the next one elsewhere), and after
//     maxConnRefusals of them the acquire fails with ErrReplicaBehind, so
//     the job fails without reading anything and the queue retries it.
//
// It also closes the restart window: a replica restarted between a job's
// routing and its read accepts connections at its minimum recovery point,
// below what it had replayed; such a connection is of a new run, and is
// checked. Crash restarts that keep the postmaster are told apart only
// when the role sees the startup process (pg_read_all_stats).
type connCheck struct {
	r     *Router
	db    string
	idx   int32
	name  string
	conns sync.Map // *pgx.Conn → connServer

	// warn logs, sampled, that the pool reaches a server the tracker does
	// not watch.
	warn rate.Sometimes
}

// connServer is what a handler connection's server said about itself
// when the connection was made.
type connServer struct {
	run    replay.RunID
	system uint64
}

// maxConnRefusals bounds the connections one acquire drops before it
// fails: enough for a balancer to send one elsewhere.
const maxConnRefusals = 3

// ErrReplicaBehind is returned (wrapped) by a routed handler's query on a
// replica pool whose connections kept reaching servers that had not
// replayed the job's token (a balanced endpoint with a lagging member, or
// a replica restarted since the decision): the job read nothing, and the
// queue retries it.
var ErrReplicaBehind = errors.New("caughtup/consume: the replica pool's connections reach a server that has not replayed the job's token; the job read nothing (point the pool at one server, or let the queue retry)")

// handlerPool builds the pool the router hands handlers for one replica,
// from the application's pool config.
func (r *Router) handlerPool(db string, idx int, rep replay.Replica) (*pgxpool.Pool, error) {
	cfg := rep.Pool.Config()
	ch := &connCheck{r: r, db: db, idx: int32(idx), name: rep.Name, warn: rate.Sometimes{First: 1, Interval: time.Minute}}
	after, prepare, beforeClose := cfg.AfterConnect, cfg.PrepareConn, cfg.BeforeClose
	if prepare == nil && cfg.BeforeAcquire != nil { //nolint:staticcheck // the application's hook, kept
		before := cfg.BeforeAcquire //nolint:staticcheck
		prepare = func(ctx context.Context, c *pgx.Conn) (bool, error) { return before(ctx, c), nil }
	}
	cfg.BeforeAcquire = nil //nolint:staticcheck
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		if after != nil {
			if err := after(ctx, c); err != nil {
				return err
			}
		}
		ch.identify(ctx, c)
		return nil
	}
	cfg.PrepareConn = func(ctx context.Context, c *pgx.Conn) (bool, error) {
		if prepare != nil {
			if ok, err := prepare(ctx, c); !ok || err != nil {
				return ok, err
			}
		}
		return ch.admit(ctx, c)
	}
	tracer := acquireTracer{ch}
	if cfg.ConnConfig.Tracer == nil {
		cfg.ConnConfig.Tracer = tracer
	} else {
		cfg.ConnConfig.Tracer = multitracer.New(cfg.ConnConfig.Tracer, tracer)
	}
	cfg.BeforeClose = func(c *pgx.Conn) {
		ch.conns.Delete(c)
		if beforeClose != nil {
			beforeClose(c)
		}
	}
	return pgxpool.NewWithConfig(context.Background(), cfg)
}

// identify records the run of the server a new connection reached. A
// connection whose server does not say is checked on every routed acquire.
func (ch *connCheck) identify(ctx context.Context, c *pgx.Conn) {
	rd, err := pgwal.ReadReplica(ctx, c, pgwal.Control|pgwal.Status)
	if err != nil {
		return
	}
	ch.conns.Store(c, connServer{
		run:    replay.Incarnation{PostmasterStart: rd.PostmasterStart, RecoveryStart: rd.RecoveryStart}.ID(),
		system: rd.Control.SystemID,
	})
}

// admit is PrepareConn: whether c may serve the acquire of ctx.
func (ch *connCheck) admit(ctx context.Context, c *pgx.Conn) (bool, error) {
	rv := routingFrom(ctx)
	if rv == nil || rv.r != ch.r {
		return true, nil // not a routed read of this router's
	}
	var dd *DatabaseDecision
	for i := range rv.d.Databases {
		if d := &rv.d.Databases[i]; d.Database == ch.db && d.replica == ch.idx {
			dd = d
		}
	}
	if dd == nil {
		return true, nil // the decision put this database elsewhere; DB never hands out this pool then
	}
	v, known := ch.conns.Load(c)
	srv, _ := v.(connServer)
	if known && !srv.run.IsZero() && srv.run == dd.server {
		ch.r.met.connection(ctx, connSameServer)
		return true, nil
	}
	ok := known && ch.verify(ctx, c, srv, dd)
	if ok {
		ch.r.met.connection(ctx, connVerified)
		ch.warn.Do(func() {
			ch.r.log.LogAttrs(ctx, slog.LevelWarn, "caughtup: the replica pool reaches a server other than the one the tracker watches (a balanced endpoint, a DNS move or a restart); each such connection costs a query per job (logged at most once a minute)",
				slog.String(attrDatabase, ch.db), slog.String(attrReplica, ch.name))
		})
		return true, nil
	}
	ch.r.met.connection(ctx, connBehind)
	if rv.refusals.Add(1) >= maxConnRefusals {
		return false, fmt.Errorf("%w (database %q, replica %q)", ErrReplicaBehind, ch.db, ch.name)
	}
	return false, nil
}

// verify asks c's server whether it has replayed what dd needs: the
// token's entry and the position the decision promised children (ReadAt),
// in the history the decision compared them in.
func (ch *connCheck) verify(ctx context.Context, c *pgx.Conn, srv connServer, dd *DatabaseDecision) bool {
	rd, err := pgwal.ReadReplica(ctx, c, 0) // the position and timeline only: the run was read at connect
	if err != nil || !rd.InRecovery || rd.Timeline == 0 || srv.system == 0 {
		return false
	}
	got := position.Replayed{Epoch: position.Epoch{SystemID: srv.system, Timeline: rd.Timeline}, LSN: rd.LSN}
	need := dd.Entry
	if dd.ReadAt.Epoch == need.Epoch && dd.ReadAt.LSN > need.LSN {
		need.LSN = dd.ReadAt.LSN
	}
	var hist position.History
	if ds := ch.r.tr.Snapshot().Database(ch.db); ds != nil && ds.Primary.HistoryKnown &&
		ds.Primary.Epoch.SystemID == got.Epoch.SystemID && got.Epoch.Timeline <= ds.Primary.Epoch.Timeline {
		hist = ds.Primary.History
	}
	return need.Compare(got, hist).Status == position.CaughtUp
}

// Results of caughtup.consume.replica.connections.
type connResult uint8

const (
	connSameServer connResult = iota // the server the decision judged: no query
	connVerified                     // another server, which had replayed the token: one query
	connBehind                       // another server behind the token, or one that could not tell: dropped
	numConnResults
)

var connResultNames = [numConnResults]string{"same_server", "verified", "behind"}

// exclusion counts a replica left out of decisions.
func (m *metrics) exclusion(ctx context.Context, database, replica, reason string) {
	m.exclusions.Add(ctx, 1, withSystem(attribute.String(attrDatabase, database), attribute.String(attrReplica, replica), attribute.String(attrReason, reason)))
}

// connection counts one routed acquire's check. It is counted on
// context.Background, not the acquire's context: the SDK's exemplar filter
// looks for a span in the context it is given, and a handler's context is
// a long chain of values (the queue's, the routing, the application's)
// that the lookup walks on every query, for an exemplar nobody reads on
// this counter. It cost ~0.6 µs per point query in the Kafka benchmark.
func (m *metrics) connection(_ context.Context, res connResult) {
	m.connections.Add(context.Background(), 1, m.connectionSets[res])
}

func newConnectionSets() [numConnResults]metric.AddOption {
	var out [numConnResults]metric.AddOption
	for i := range out {
		out[i] = withSystem(attribute.String(attrResult, connResultNames[i]))
	}
	return out
}

// ErrMultiplexedReplica is wrapped by NewRouter's error for a replica pool
// one of whose connections reached several servers from one statement to
// the next: a transaction-mode pooler (PgBouncer) over several standbys.
// No check on a connection then says which server the next statement
// reads, so the router refuses the pool rather than route reads it cannot
// tie to the server it judged.
var ErrMultiplexedReplica = errors.New("caughtup/consume: a replica pool's connection reaches several servers, one transaction to the next (a transaction-mode pooler over several standbys); give each standby its own pool or pooler database, or use session pooling")

// probe asks each replica pool, on a few connections at once and a few
// times on each, which server run it reaches. A connection that answers
// with several (a pooler switching servers per transaction) fails
// NewRouter; several connections that each reach one server of several (a
// balancer) are logged, since each connection is checked when a handler
// acquires it. A pool that cannot be reached now is left to the tracker.
func (r *Router) probe(ctx context.Context) error {
	for name, db := range r.pools {
		for _, rep := range db.Replicas {
			if rep.Pool == nil {
				continue
			}
			servers, multiplexed := probePool(ctx, rep.Pool)
			if multiplexed {
				return fmt.Errorf("%w (database %q, replica %q: one connection reached %s)", ErrMultiplexedReplica, name, rep.Name, describeRuns(servers))
			}
			if len(servers) > 1 {
				r.log.WarnContext(ctx, "caughtup: a replica pool reaches several servers (a balancer, a multi-host DSN or a DNS name over several standbys); each handler connection is checked against the server the decision judged, at one query per job when it is not the one the tracker watches",
					slog.String(attrDatabase, name), slog.String(attrReplica, rep.Name), slog.String("caughtup.servers", describeRuns(servers)))
			}
		}
	}
	return nil
}

// probePool returns the server runs a pool's connections reached, and
// whether one connection reached several. Two connections at once, so
// that a balancer can send them apart, and the first holds a transaction
// open while the second asks, then ends it before the second asks again:
// a transaction-mode pooler must give the second a server connection of
// its own while the first holds one, and then, reusing the most recently
// released first, hands it the first's, which over several standbys can
// be another server.
func probePool(ctx context.Context, p *pgxpool.Pool) (servers []replay.RunID, multiplexed bool) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	seen := map[replay.RunID]bool{}
	ask := func(q pgwal.Querier, last *replay.RunID) bool {
		rd, err := pgwal.ReadReplica(ctx, q, pgwal.Status)
		if err != nil {
			return false
		}
		run := replay.Incarnation{PostmasterStart: rd.PostmasterStart}.ID()
		if !last.IsZero() && run != *last {
			multiplexed = true
		}
		*last = run
		if !seen[run] {
			seen[run] = true
			servers = append(servers, run)
		}
		return true
	}
	c1, err := p.Acquire(ctx)
	if err != nil {
		return nil, false
	}
	defer c1.Release()
	c2, err := p.Acquire(ctx)
	if err != nil {
		return nil, false
	}
	defer c2.Release()
	var on1, on2 replay.RunID
	for range 2 {
		tx, err := c1.Begin(ctx)
		if err != nil {
			return servers, multiplexed
		}
		ok := ask(tx, &on1) && ask(c2, &on2)
		_ = tx.Rollback(ctx)
		if !ok || !ask(c2, &on2) || !ask(c1, &on1) {
			break
		}
	}
	return servers, multiplexed
}

// describeRuns names server runs by their postmaster start, the part every
// role can read.
func describeRuns(runs []replay.RunID) string {
	var b []byte
	for i, r := range runs {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = append(b, "the server started "...)
		b = r.Incarnation().PostmasterStart.UTC().AppendFormat(b, time.RFC3339Nano)
	}
	return string(b)
}
