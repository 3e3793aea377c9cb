package lab

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// The weighted-balancer scenario (issue 36 §1): the router's one replica
// pool is a PgBouncer in transaction pooling whose one database entry
// points at an HAProxy balancing over both standbys with weights 9:1, as a
// new user would set it up, and pgx speaks the simple protocol, as
// PgBouncer 1.18 in transaction pooling needs. PgBouncer hands each
// transaction to any of its server connections, about one in ten of which
// reach the lightly weighted standby, so no sample of the pool's
// connections tells which server the next read runs on: every routed read
// must be checked in the transaction it runs in. Replay pauses at random
// on the lightly weighted standby, and other clients run short
// transactions through the same PgBouncer database all along, so that
// server connections keep changing hands.

// weightedHeavy is replica1's HAProxy weight; replica2's is 1.
const weightedHeavy = 9

// weightedOthers is how many other clients run short transactions
// through the PgBouncer database, each at most one per weightedOtherGap.
const (
	weightedOthers   = 4
	weightedOtherGap = 10 * time.Millisecond
)

func weightedScenario(sl scale) *scenario {
	return &scenario{
		name: "weighted-balancer",
		about: fmt.Sprintf("the router's one replica pool is a PgBouncer in transaction pooling (pgx simple protocol) whose one database entry is an "+
			"HAProxy balancing over both standbys with weights %d:1 (testkit/proxytest); replay paused at random on the lightly weighted standby "+
			"for up to %s, with rests of up to %s; %d other clients run short transactions through the same PgBouncer database; "+
			"the kafka-go Consumers route by themselves", weightedHeavy, sl.maxPause, balancedGap, weightedOthers),
		policy:       consume.Delayed,
		replicaPools: weightedPools,
		kafkaRoutes:  true,
		span:         func(s scale) time.Duration { return s.span(s.lead + 2*s.maxPause + s.tail) },
		fault:        pauseLightStandby,
		check:        checkWeighted,
	}
}

type weightedState struct {
	haproxy *proxytest.HAProxy
	bouncer *proxytest.PgBouncer
	// others is the other clients' pool on the PgBouncer database.
	others *pgxpool.Pool
	light  *pgtest.Node

	pauses int
	paused time.Duration // summed over the pauses
	// otherTx and otherErrs count the other clients' transactions and
	// those that failed.
	otherTx, otherErrs atomic.Int64
	// sessions are HAProxy's server connections per server (s1, s2) at
	// the end of the fault.
	sessions map[string]int64
}

func weightedOf(r *run) *weightedState {
	st, _ := r.state.(*weightedState)
	return st
}

// weightedPools starts the HAProxy over the cluster's standbys, weighted
// 9:1, a PgBouncer in front of it, and returns one pool through the
// PgBouncer.
func weightedPools(ctx context.Context, r *run) ([]replay.Replica, error) {
	nodes := r.cluster.Replicas()
	h, err := proxytest.NewHAProxy(ctx, proxytest.HAProxyConfig{Backends: proxytest.Addrs(nodes...)})
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, func() { _ = h.Close() })
	if err := h.SetWeight(h.Server(0), weightedHeavy); err != nil {
		return nil, err
	}
	if err := h.SetWeight(h.Server(1), 1); err != nil {
		return nil, err
	}
	// Server connections are kept at the pool size, reused in turn
	// rather than last-released first, and live a second: under LIFO
	// reuse the few connections a light load keeps busy could all be on
	// the heavily weighted standby, and a connection the router gives back
	// for being behind ends its server connection, which PgBouncer
	// replaces through the balancer (nine times in ten on the heavy
	// standby). Renewed every second, about one in ten server connections
	// reaches the light standby throughout, as the weights say.
	b, err := proxytest.NewPgBouncer(ctx, proxytest.PgBouncerConfig{
		Backends: []string{h.Addr()}, PoolMode: "transaction", ServerRoundRobin: true,
		Settings: map[string]string{"min_pool_size": "20", "server_lifetime": "0.25"},
	})
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, func() { _ = b.Close() })
	cfg, err := pgxpool.ParseConfig(b.DSN(r.env.name))
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 24 // as newDBEnv's pool per standby
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, p.Close)
	ocfg, err := pgxpool.ParseConfig(b.DSN(r.env.name))
	if err != nil {
		return nil, err
	}
	ocfg.MaxConns = weightedOthers
	others, err := pgxpool.NewWithConfig(ctx, ocfg)
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, others.Close)
	r.state = &weightedState{haproxy: h, bouncer: b, others: others, light: nodes[1]}
	return []replay.Replica{{Name: "pgbouncer", Pool: p}}, nil
}

// pauseLightStandby runs the other clients for the whole span and pauses
// replay on the lightly weighted standby at random from the lead until
// the tail, for up to maxPause each.
func pauseLightStandby(ctx context.Context, r *run) error {
	st := weightedOf(r)
	octx, stopOthers := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range weightedOthers {
		wg.Go(func() { st.otherClient(octx) })
	}
	defer func() {
		stopOthers()
		wg.Wait()
	}()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	light := []*pgtest.Node{st.light}
	defer resumeAll(light)
	end := r.start.Add(r.sc.span(r.sl) - r.sl.tail)
	for time.Now().Before(end) {
		if err := st.light.PauseReplay(ctx); err != nil {
			return err
		}
		from := time.Now()
		if st.pauses == 0 {
			r.event("first pause: replay on %s, the standby HAProxy (%s) weights 1 against %d, behind PgBouncer (%s, transaction pooling)",
				st.light.Name(), st.haproxy.Addr(), weightedHeavy, st.bouncer.Addr())
		}
		st.pauses++
		sleepCtx(ctx, min(r.sl.maxPause/5+rand.N(r.sl.maxPause*4/5+1), time.Until(end)))
		if err := resumeAll(light); err != nil {
			return err
		}
		st.paused += time.Since(from)
		if !sleepCtx(ctx, rand.N(balancedGap+1)) {
			return ctx.Err()
		}
	}
	r.event("pauses done: %d on %s, %.1fs paused in all", st.pauses, st.light.Name(), st.paused.Seconds())
	if err := r.at(ctx, r.sc.span(r.sl)); err != nil {
		return err
	}
	sessions, err := haproxySessions(st.haproxy)
	if err != nil {
		return err
	}
	st.sessions = sessions
	return nil
}

// otherClient runs short transactions through the PgBouncer database
// until ctx ends: each takes a server connection, which the next routed
// read may then get, or not.
func (st *weightedState) otherClient(ctx context.Context) {
	for ctx.Err() == nil {
		err := func() error {
			tx, err := st.others.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			_, err = tx.Exec(ctx, "SELECT pg_backend_pid()")
			return err
		}()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			st.otherErrs.Add(1)
		} else {
			st.otherTx.Add(1)
		}
		sleepCtx(ctx, rand.N(weightedOtherGap+1))
	}
}

// haproxySessions reads how many connections HAProxy has sent to each
// server of its backend (show stat: stot), by server name.
func haproxySessions(h *proxytest.HAProxy) (map[string]int64, error) {
	out, err := h.Command("show stat")
	if err != nil {
		return nil, err
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) == 0 || !strings.HasPrefix(lines[0], "# ") {
		return nil, fmt.Errorf("haproxy show stat: no header in %q", out)
	}
	col := map[string]int{}
	for i, name := range strings.Split(strings.TrimPrefix(lines[0], "# "), ",") {
		col[name] = i
	}
	px, sv, stot := col["pxname"], col["svname"], col["stot"]
	got := map[string]int64{}
	for _, l := range lines[1:] {
		f := strings.Split(l, ",")
		if len(f) <= max(px, sv, stot) || f[sv] == "BACKEND" || f[sv] == "FRONTEND" {
			continue
		}
		for i := range h.Backends() {
			if f[sv] == h.Server(i) {
				n, err := strconv.ParseInt(f[stot], 10, 64)
				if err != nil {
					return nil, fmt.Errorf("haproxy show stat: stot of %s: %w", f[sv], err)
				}
				got[f[sv]] += n
			}
		}
	}
	return got, nil
}

// checkWeighted says what the checks did, and fails the run if the fault
// or the balancer did not take effect, or a routed read through the
// pooler went unchecked.
func checkWeighted(r *run, res *scenarioResult) {
	st := weightedOf(r)
	conns := r.metrics.sum("caughtup.consume.replica.connections", "caughtup.result")
	r.note("routed acquires of replica connections (caughtup.consume.replica.connections): checked in their transaction %d, "+
		"behind and given back %d, same server %d, verified %d; replica exclusions %v",
		conns["in_transaction"], conns["behind"], conns["same_server"], conns["verified"],
		r.metrics.sum("caughtup.consume.replica.exclusions", "caughtup.reason"))
	if st == nil {
		r.fail("the PgBouncer and HAProxy were never set up")
		return
	}
	r.note("other clients: %d short transactions through the PgBouncer database (%d failed); HAProxy server connections by server: %v (weights %d:1)",
		st.otherTx.Load(), st.otherErrs.Load(), st.sessions, weightedHeavy)
	r.noteReplicaFailed(res)
	r.note("primary reads by reason: %v", r.primaryReasons())
	if st.pauses == 0 {
		r.fail("replay was never paused")
	}
	if conns["in_transaction"] == 0 {
		r.fail("no routed read through the pooler was checked in its transaction")
	}
	if n := conns["same_server"] + conns["verified"]; n > 0 {
		r.fail("%d routed acquires through the pooler were admitted as direct connections (same server or verified once): a later transaction may run elsewhere", n)
	}
	if st.sessions[st.haproxy.Server(1)] == 0 {
		r.fail("HAProxy sent no server connection to the lightly weighted standby: the balancer never mattered")
	}
	if conns["behind"] == 0 {
		r.fail("no routed read's transaction reached the paused standby: the pauses never mattered")
	}
	if st.otherTx.Load() == 0 {
		r.fail("the other clients ran no transaction")
	}
}

// noteReplicaFailed notes, per stream, the handler runs a replica failed
// and the runs that completed with a retry count above 0.
func (r *run) noteReplicaFailed(res *scenarioResult) {
	streams := res.Streams
	if len(streams) > 1 {
		streams = streams[:len(streams)-1] // not the totals
	}
	var by []string
	for _, sr := range streams {
		by = append(by, fmt.Sprintf("%s %d (completed with retry count > 0: %d)", sr.Stream, sr.ReplicaFailed, sr.RetriedRuns))
	}
	r.note("handler runs a replica failed (consume.ReplicaFailed), routed again without spending an attempt, by stream: %s", strings.Join(by, ", "))
}

// primaryReasons counts the reads on the primary of every stream by the
// decision's reason.
func (r *run) primaryReasons() map[string]int {
	out := map[string]int{}
	for _, st := range r.streams() {
		st.mu.Lock()
		for _, rd := range st.reads {
			if rd.replica == "" {
				out[rd.reason]++
			}
		}
		st.mu.Unlock()
	}
	return out
}
