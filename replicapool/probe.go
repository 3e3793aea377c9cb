package replicapool

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// Probe's budget per pool: a lagging replica meets every waiting job, and
// each probe costs a query (and may cost a connection).
const (
	probeRate  = 20
	probeBurst = 4
)

// probeKey marks Probe's own acquires, which admit checks no further: Probe
// checks the connection itself. reprobeKey marks a re-probe's, whose
// failure the re-probe records itself.
type (
	probeKey   struct{}
	reprobeKey struct{}
)

// Found is what Probe found: a server behind the pool that has replayed
// what the job needs.
type Found struct {
	// Server is its run.
	Server replay.RunID
	// Replayed is what it had replayed when asked.
	Replayed position.Replayed
}

// Probe looks for a server behind the pool that has replayed need, for a
// job that no server the tracker knows of can serve yet. It takes a
// connection and, unless the server table already knows its server has
// replayed need, asks it (one query); a connection whose server is
// behind while another server behind the pool is known to be further on
// is given back closed, so that a balancer or pooler picks again for the
// next, up to MaxRefusals connections. Whatever it reads goes into the
// server table, where Lift finds it for every job. It reports false
// without taking a connection when the pool's probe budget (20 a second,
// whatever the number of jobs that wait) is spent, or while the replica is
// excluded.
func (p *Pool) Probe(ctx context.Context, need position.Entry) (Found, bool) {
	if !p.health.excludedUntil().IsZero() || !p.probes.Allow() {
		return Found{}, false // out of this process's reach: the re-probe tells when it is back
	}
	ctx = context.WithValue(ctx, probeKey{}, true)
	cutoff := p.cfg.Now().Add(-SeenWindow)
	for range MaxRefusals {
		c, err := p.pool.Acquire(ctx)
		if err != nil {
			return Found{}, false // counted by the acquire's tracer
		}
		f, found, closeIt := p.probeConn(ctx, c, need, cutoff)
		// Until the pool has shown whether it reaches one server, each
		// probe's connection is a new one: a balancer shows its other
		// servers only to new connections. That costs a pool that does
		// reach one server discoverConns connections, once.
		if closeIt || p.servers.topology(p.cfg.Now()) == TopologyUnknown {
			_ = c.Conn().Close(ctx)
		}
		c.Release()
		if found || !closeIt {
			return f, found
		}
	}
	return Found{}, false
}

// probeConn checks one connection for Probe; closeIt: its server is behind
// and another is known to be further on.
func (p *Pool) probeConn(ctx context.Context, c *pgxpool.Conn, need position.Entry, cutoff time.Time) (f Found, found, closeIt bool) {
	v, _ := p.conns.Load(c.Conn())
	ci, _ := v.(*conn)
	if ci == nil {
		return Found{}, false, false
	}
	var got position.Replayed
	var run replay.RunID
	if ci.pooled || p.servers.pooled.Load() {
		rd, err := pgwal.BeginReadReplica(ctx, c.Conn().PgConn(), pgwal.Control|pgwal.Status)
		ci.inTx = c.Conn().PgConn().TxStatus() != 'I'
		if err != nil {
			return Found{}, false, false
		}
		run, got = runOf(rd), replayedOf(rd, rd.Control.SystemID)
	} else {
		if p.servers.knows(ci.run, need, p.caughtUp) {
			r, _ := p.servers.replayed(ci.run)
			p.servers.touch(ci.run, p.cfg.Now())
			return Found{Server: ci.run, Replayed: r}, true, false
		}
		rd, err := pgwal.ReadReplica(ctx, c.Conn(), pgwal.Backend)
		if err != nil || ci.system == 0 {
			return Found{}, false, false
		}
		if rd.BackendPID != ci.pid {
			p.markPooled(true)
			return Found{}, false, true
		}
		run, got = ci.run, replayedOf(rd, ci.system)
	}
	p.servers.learn(run, got, p.cfg.Now())
	if p.caughtUp(need, got) {
		return Found{Server: run, Replayed: got}, true, false
	}
	return Found{}, false, p.servers.better(run, got, cutoff)
}

// Lift returns the state a router's decisions should see for the replica,
// given st, the tracker's: st itself, or, when the server table knows a
// server behind the pool, reached within SeenWindow, that has replayed
// further than the server st describes, st with that server's position and
// run, so that jobs that server can serve go to the pool, and connections
// to it are admitted with no query. Only a pool the tracker reaches (st
// fresh at cutoff, in recovery, without error) is lifted: unknown stays
// infinitely behind. validUntil is when the lifted server stops counting
// as reachable; zero when st is returned.
//
// The lift never makes a read stale: every connection a routed handler
// gets is still checked against the job's position (a server the table
// does not know to be there costs a query), so at worst a job routed to
// the pool finds no server and is routed again.
func (p *Pool) Lift(st replay.ReplicaState, primary *replay.PrimaryState, maxLagBytes uint64, now, cutoff time.Time) (out replay.ReplicaState, lifted bool, validUntil time.Time) {
	if st.Err != nil || !st.InRecovery || st.Stale(cutoff) {
		return st, false, time.Time{}
	}
	// Only servers heard of since the tracker's server run began count: a
	// run last seen before it is most likely that server's previous run,
	// gone with its restart (whose hold must stand), or a server gone
	// from behind the endpoint.
	p.servers.learnFrom(st.Run, st.Replayed, st.ObservedAt, false)
	since := maxTime(now.Add(-SeenWindow), p.servers.firstSeen(st.Run))
	best, ok := p.servers.best(st.Run, since)
	// Past the tracker's server, and past what the pool ever showed
	// before a restart of it (a new run of that server that the table met
	// under another name must not end its hold).
	if !ok || !later(best.replayed, st.Replayed) || best.replayed.LSN < st.RestartFloor {
		return st, false, time.Time{}
	}
	out = st
	out.Replayed = best.replayed
	out.Run, out.Incarnation = best.run, best.run.Incarnation()
	out.RestartFloor = 0 // the facts about this run were read from it
	out.LagKnown, out.LagBytes = false, 0
	if primary != nil && primary.Epoch == best.replayed.Epoch && primary.InsertLSN >= best.replayed.LSN {
		out.LagKnown, out.LagBytes = true, best.replayed.LSN.BytesBefore(primary.InsertLSN)
	}
	out.Healthy = !out.LagKnown || out.LagBytes <= maxLagBytes
	out.HighestReplayed = max(out.HighestReplayed, best.replayed.LSN)
	return out, true, best.seenAt.Add(SeenWindow)
}
