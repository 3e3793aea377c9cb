package consume

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/replicapool"
)

// Each handler connection is tied to a server known to have replayed the
// job's token: the Router hands its handlers, for each replica, a pool of
// its own built from the configured one's config (package replicapool),
// whose every routed acquire is checked against the decision in the
// handler's context. A direct connection to a server known to have
// replayed the token costs nothing, one to another server one query; a
// connection through a pooler is checked in the transaction its reads run
// in. A connection whose server is behind is given back and another taken;
// after replicapool.MaxRefusals the acquire fails with ErrReplicaBehind,
// the job read nothing, and ReplicaFailed tells its adapter to route it
// again without spending an attempt.

// ErrReplicaBehind is returned (wrapped) by a routed handler's query on a
// replica pool whose connections kept reaching servers that had not
// replayed the job's token (a balanced endpoint whose choice moved to a
// lagging member, a replica restarted since the decision): the query read
// nothing, and ReplicaFailed reports true for the job's context.
var ErrReplicaBehind = replicapool.ErrReplicaBehind

// ErrUnreachable is the Err a Router's Snapshot shows for a replica its
// handlers could not connect to lately; it wraps the connection error.
var ErrUnreachable = replicapool.ErrUnreachable

// ErrMultiplexedReplica was wrapped by NewRouter's error for a replica
// pool one of whose connections reached several servers.
//
// Deprecated: NewRouter no longer refuses such pools (a transaction-mode
// pooler over several standbys): every routed read on them is checked in
// the transaction it runs in. Nothing returns this error.
var ErrMultiplexedReplica = errors.New("caughtup/consume: a replica pool's connection reaches several servers, one transaction to the next")

// ReplicaFailed reports whether, in the handler's context ctx (from
// Route), a replica the decision chose failed the job: a connection to it
// could not be made or broke, or its connections kept reaching servers
// behind the job (ErrReplicaBehind). The router has left that replica out
// of its decisions meanwhile. Such a failure is the router's, not the
// job's: adapters route the job again (it may go to another replica, wait,
// be deferred or read the primary under the cap) without counting a
// failed attempt. False for a context Route did not make.
func ReplicaFailed(ctx context.Context) bool {
	rv := routingFrom(ctx)
	return rv != nil && rv.attempt.Failed()
}

// MaxReroutes bounds how many times an adapter routes one run of a job
// again, in place, after a replica failed it (ReplicaFailed): the router
// leaves a failing replica out at its first failure, so the next route
// goes elsewhere; a job that keeps meeting failures after that many is
// deferred (or snoozed) instead, again without counting an attempt.
const MaxReroutes = 3

// handlerPool builds the pool the router hands handlers for replica idx of
// database db.
func (r *Router) handlerPool(db string, idx int, rep replay.Replica) (*replicapool.Pool, error) {
	return replicapool.New(rep.Pool, replicapool.Config{
		Database: db,
		Replica:  rep.Name,
		Target:   r.target(db, int32(idx)),
		Primary: func() *replay.PrimaryState {
			if r.tr == nil {
				return nil
			}
			if ds := r.tr.Snapshot().Database(db); ds != nil {
				return &ds.Primary
			}
			return nil
		},
		Events: poolEvents{r: r, db: db, replica: rep.Name},
		Logger: r.log,
		Now:    r.cfg.Now,
		Gen:    &r.poolGen,
	})
}

// target is what a routed acquire of replica idx of database db needs:
// the position of the database's decision, raised to what it promised
// children (ReadAt), and the server it judged.
func (r *Router) target(db string, idx int32) func(context.Context) (replicapool.Target, bool) {
	return func(ctx context.Context) (replicapool.Target, bool) {
		rv := routingFrom(ctx)
		if rv == nil || rv.src.r != r {
			return replicapool.Target{}, false // not a routed read of this router's
		}
		for i := range rv.d.Databases {
			dd := &rv.d.Databases[i]
			if dd.Database != db || dd.replica != idx {
				continue
			}
			need := dd.Entry
			if dd.ReadAt.Epoch == need.Epoch && dd.ReadAt.LSN > need.LSN {
				need.LSN = dd.ReadAt.LSN
			}
			return replicapool.Target{Need: need, Server: dd.server, Attempt: &rv.attempt}, true
		}
		return replicapool.Target{}, false // the decision put this database elsewhere; Pool never hands out this pool then
	}
}

// poolEvents counts what a replica's handler pool finds.
type poolEvents struct {
	r           *Router
	db, replica string
}

// Checked counts one check: in the Tally that routed the acquire's job,
// if one did (an OpenTelemetry Add per point query was about 0.5 µs of
// the 20 a Kafka record with one cost), else at once.
func (e poolEvents) Checked(ctx context.Context, c replicapool.Check) {
	if rv := routingFrom(ctx); rv != nil && rv.src.t != nil && rv.src.r == e.r {
		rv.src.t.conns[c].Add(1)
		return
	}
	if m := e.r.met; m != nil {
		m.connection(c)
	}
}

func (e poolEvents) Excluded(reason replicapool.Reason, _ error) {
	if m := e.r.met; m != nil {
		m.exclusion(context.Background(), e.db, e.replica, reason.String())
	}
}

func (poolEvents) Readmitted() {}

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
func (m *metrics) connection(res replicapool.Check) {
	m.connections.Add(context.Background(), 1, m.connectionSets[res])
}

func newConnectionSets() [replicapool.NumChecks]metric.AddOption {
	var out [replicapool.NumChecks]metric.AddOption
	for i := range out {
		out[i] = withSystem(attribute.String(attrResult, replicapool.Check(i).String()))
	}
	return out
}

// handlerPools are the pools a Router hands its handlers, per database in
// Config order of replicas; nil for a replica without a pool (a unit
// test's router over a fixed snapshot).
type handlerPools map[string][]*replicapool.Pool

// closeAll closes every handler pool.
func (h handlerPools) closeAll() {
	for _, ps := range h {
		for _, p := range ps {
			if p != nil {
				p.Close()
			}
		}
	}
}

// handed is the *pgxpool.Pool of a handler pool, nil for none.
func handed(p *replicapool.Pool) *pgxpool.Pool {
	if p == nil {
		return nil
	}
	return p.Handlers()
}
