package replicapool

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/multitracer"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// MaxRefusals bounds the connections one job's acquires give back because
// their server was behind, before an acquire fails with ErrReplicaBehind:
// enough for a balancer or pooler to pick another server a few times.
const MaxRefusals = 4

// ErrReplicaBehind is returned (wrapped) by a routed handler's query on a
// replica pool whose connections kept reaching servers that had not
// replayed the job's token (a balanced endpoint whose choice moved to a
// lagging member, a replica restarted since the decision): the query read
// nothing, and the job's Attempt says so, so that the router re-routes it.
var ErrReplicaBehind = errors.New("caughtup/consume: the replica pool's connections reach a server that has not replayed the job's token; the query read nothing (point the pool at one server, or let the job be routed again)")

// Config configures a Pool.
type Config struct {
	// Database and Replica name the replica in logs and errors. Required.
	Database, Replica string
	// Target returns what a routed acquire in ctx needs of the server it
	// reaches, and false when ctx is not a routed read of this replica:
	// such an acquire is admitted unchecked. Required.
	Target func(ctx context.Context) (Target, bool)
	// Primary returns the tracker's current state of the database's
	// primary, whose timeline history positions are compared in. Required.
	Primary func() *replay.PrimaryState
	// Events receives the checks and exclusions, for metrics.
	// Default: none.
	Events Events
	// Logger logs exclusions and what the pool's connections show of its
	// servers.
	// Default: slog.Default().
	Logger *slog.Logger
	// Now is the clock of exclusions and the server table.
	// Default: time.Now.
	Now func() time.Time
	// Gen, if set, is increased whenever something a router derives from
	// the pool (Excluded, Lift) may have changed; several pools may share
	// one.
	// Default: a counter of the pool's own.
	Gen *atomic.Uint64
}

// Target is what a routed acquire needs of the server it reaches.
type Target struct {
	// Need is the position the server must have replayed, in its epoch:
	// the token's entry for the database, raised to what the decision
	// promised the job's children.
	Need position.Entry
	// Server is the run of the server the decision judged: a direct
	// connection to it needs no query. Zero: none.
	Server replay.RunID
	// Attempt is the job's; nil counts nothing per job.
	Attempt *Attempt
}

// Attempt is what one routed run of a job met on the replica pools it was
// handed: the connections given back, and whether a replica failed it.
// The zero value is ready; a router embeds one in each handler context.
type Attempt struct {
	refusals atomic.Int32
	failed   atomic.Bool
}

// Failed reports whether a replica chosen for the job failed it: a
// connection could not be made or broke, or every connection reached a
// server behind the job. The job read nothing wrong, and can be routed
// again without counting as a failed attempt.
func (a *Attempt) Failed() bool { return a != nil && a.failed.Load() }

// Refused reports whether a connection was given back for being behind.
func (a *Attempt) Refused() bool { return a != nil && a.refusals.Load() > 0 }

// Fail records that a replica failed the job. The pool records what its
// connections meet itself; a caller that learns of a failure another way
// (its own check on a connection) may too.
func (a *Attempt) Fail() {
	if a != nil {
		a.failed.Store(true)
	}
}

// Check is the result of one routed acquire's check (Events.Checked).
type Check uint8

const (
	// CheckSameServer: a direct connection to a server known to have
	// replayed what the job needs; no query.
	CheckSameServer Check = iota
	// CheckVerified: a direct connection to another server, which one
	// query found caught up.
	CheckVerified
	// CheckInTransaction: a pooled connection, checked in the transaction
	// its reads run in.
	CheckInTransaction
	// CheckBehind: the connection's server was behind, or could not tell;
	// it was given back.
	CheckBehind
	NumChecks
)

// String is the check's name in metrics ("same_server", "verified",
// "in_transaction", "behind").
func (c Check) String() string {
	switch c {
	case CheckSameServer:
		return "same_server"
	case CheckVerified:
		return "verified"
	case CheckInTransaction:
		return "in_transaction"
	}
	return "behind"
}

// Events receives what a Pool finds; its methods must be quick and safe
// for concurrent use.
type Events interface {
	// Checked: one routed acquire's check, in the acquire's context (the
	// handler's, which says whose job it was).
	Checked(context.Context, Check)
	// Excluded: the replica left the router's decisions (once per
	// exclusion, however many failures extend it).
	Excluded(reason Reason, err error)
	// Readmitted: it is back.
	Readmitted()
}

type noEvents struct{}

func (noEvents) Checked(context.Context, Check) {}
func (noEvents) Excluded(Reason, error)         {}
func (noEvents) Readmitted()                    {}

// Pool is one replica's handler pool with its checks, server table and
// health. It is safe for concurrent use.
type Pool struct {
	cfg     Config
	pool    *pgxpool.Pool
	conns   sync.Map // *pgx.Conn → *conn
	servers servers
	health  health
	log     *slog.Logger // through logAt, which names the replica

	// maxRefusals is MaxRefusals within what pgxpool tries per acquire
	// (MaxConns+1, expired connections included).
	maxRefusals int32
	// behind counts the jobs in a row that found only servers behind
	// them; a routed acquire that finds one caught up starts it again.
	behind behindRun

	// probes limits Probe's connections: each costs a query, and a
	// lagging replica meets many waiting jobs.
	probes *rate.Limiter

	warnOther  rate.Sometimes
	warnPooled sync.Once
	warnMoved  sync.Once

	ctx    context.Context // ends at Close: re-probes
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// conn is what a handler connection's server said about itself when the
// connection was made, and, for a pooled connection held by a routed
// acquire, the transaction its check opened.
type conn struct {
	run    replay.RunID
	system uint64
	pid    uint32 // pg_backend_pid() at connect
	pooled bool

	// Set while a routed acquire holds a pooled connection (one goroutine
	// at a time: the pool hands a connection to one acquirer).
	held    bool // a routed acquire holds it, checked
	inTx    bool // a transaction of the pool's is open (ROLLBACK at release)
	need    position.Entry
	attempt *Attempt
}

// New builds the handler pool of one replica from template's config (the
// application's pool: hooks, TLS and credentials included; MinConns and
// MinIdleConns are not kept). It connects nothing until a handler
// acquires.
func New(template *pgxpool.Pool, cfg Config) (*Pool, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Events == nil {
		cfg.Events = noEvents{}
	}
	if cfg.Gen == nil {
		cfg.Gen = new(atomic.Uint64)
	}
	if cfg.Target == nil || cfg.Primary == nil {
		return nil, errors.New("caughtup/replicapool: Config.Target and Config.Primary are required")
	}
	p := &Pool{
		cfg:       cfg,
		log:       cfg.Logger,
		probes:    rate.NewLimiter(probeRate, probeBurst),
		warnOther: rate.Sometimes{First: 1, Interval: time.Minute},
	}
	p.servers.gen = cfg.Gen
	p.ctx, p.cancel = context.WithCancel(context.Background())
	pc := template.Config()
	p.maxRefusals = min(MaxRefusals, max(pc.MaxConns, 1))
	// Nothing before a job needs it: a fleet that restarts at once must
	// not open MinConns connections to every replica from every process.
	pc.MinConns, pc.MinIdleConns = 0, 0
	after, prepare, beforeClose := pc.AfterConnect, pc.PrepareConn, pc.BeforeClose
	if prepare == nil && pc.BeforeAcquire != nil { //nolint:staticcheck // the application's hook, kept
		before := pc.BeforeAcquire //nolint:staticcheck
		prepare = func(ctx context.Context, c *pgx.Conn) (bool, error) { return before(ctx, c), nil }
	}
	pc.BeforeAcquire = nil //nolint:staticcheck
	pc.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		if after != nil {
			if err := after(ctx, c); err != nil {
				return err
			}
		}
		p.identify(ctx, c)
		return nil
	}
	pc.PrepareConn = func(ctx context.Context, c *pgx.Conn) (bool, error) {
		if prepare != nil {
			if ok, err := prepare(ctx, c); !ok || err != nil {
				return ok, err
			}
		}
		return p.admit(ctx, c)
	}
	hooks := poolHooks{p}
	if pc.ConnConfig.Tracer == nil {
		pc.ConnConfig.Tracer = hooks
	} else {
		pc.ConnConfig.Tracer = multitracer.New(pc.ConnConfig.Tracer, hooks)
	}
	pc.BeforeClose = func(c *pgx.Conn) {
		p.conns.Delete(c)
		if beforeClose != nil {
			beforeClose(c)
		}
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		p.cancel()
		return nil, err
	}
	p.pool = pool
	return p, nil
}

// Handlers is the pool handed to routed handlers.
func (p *Pool) Handlers() *pgxpool.Pool { return p.pool }

// Close stops re-probes and closes the handler pool.
func (p *Pool) Close() {
	p.cancel()
	p.wg.Wait()
	p.pool.Close()
}

// Topology is what the pool's connections have shown so far.
func (p *Pool) Topology() Topology { return p.servers.topology(p.cfg.Now()) }

// caughtUp reports whether got (a server's replay position) is at or past
// need, compared as Decide compares them: in the primary's history, with
// an insert position just past a page header taken at the page boundary
// (position.WALLayout.InsertEnd), where a caught-up replay stops.
func (p *Pool) caughtUp(need position.Entry, got position.Replayed) bool {
	if got.LSN == 0 {
		return false
	}
	if ps := p.cfg.Primary(); ps != nil {
		need.LSN = ps.WAL.InsertEnd(need.LSN)
	}
	return need.Compare(got, p.history(got.Epoch)).Status == position.CaughtUp
}

// history is the primary's history if positions of epoch compare in it.
func (p *Pool) history(epoch position.Epoch) position.History {
	ps := p.cfg.Primary()
	if ps != nil && ps.HistoryKnown && ps.Epoch.SystemID == epoch.SystemID && epoch.Timeline <= ps.Epoch.Timeline {
		return ps.History
	}
	return nil
}

// identify records the run of the server a new connection reached, and
// whether a pooler stands between: the server process that answers
// (pg_backend_pid) is then not the one the key data named. A connection
// whose server does not say is checked on every routed acquire.
func (p *Pool) identify(ctx context.Context, c *pgx.Conn) {
	rd, err := pgwal.ReadReplica(ctx, c, pgwal.Control|pgwal.Status|pgwal.Backend)
	if err != nil {
		return
	}
	now := p.cfg.Now()
	ci := &conn{run: runOf(rd), system: rd.Control.SystemID, pid: rd.BackendPID, pooled: pgwal.ThroughPooler(c.PgConn(), rd.BackendPID)}
	p.conns.Store(c, ci)
	p.servers.identifiedConn()
	if ci.pooled {
		p.markPooled(false)
	}
	// A fact about a server run, whichever way the connection reached it.
	p.servers.learn(ci.run, replayedOf(rd, ci.system), now)
	if p.health.succeeded() == readmitted {
		p.readmitted()
	}
}

// markPooled makes every routed acquire of the pool check in its
// transaction from now on. moved: a direct connection's server process
// changed, which no proxy but a multiplexing one does.
func (p *Pool) markPooled(moved bool) {
	if p.servers.pooled.Swap(true) {
		return
	}
	p.cfg.Gen.Add(1)
	if moved {
		p.warnMoved.Do(func() {
			p.logAt(slog.LevelError, "caughtup: a connection of the replica pool reached another server process between two checks: something between the pool and its servers multiplexes connections without saying so; from now on: "+TopologyPooled.Cost())
		})
		return
	}
	p.warnPooled.Do(func() {
		p.logAt(slog.LevelInfo, "caughtup: the replica pool reaches its servers through a pooler (PgBouncer or the like), which may run each transaction on another server: "+TopologyPooled.Cost())
	})
}

// logAt logs msg with the replica's names and attrs.
func (p *Pool) logAt(level slog.Level, msg string, attrs ...slog.Attr) {
	attrs = append([]slog.Attr{slog.String("caughtup.database", p.cfg.Database), slog.String("caughtup.replica", p.cfg.Replica)}, attrs...)
	p.log.LogAttrs(context.Background(), level, msg, attrs...)
}

// admit is PrepareConn: whether c may serve the acquire of ctx.
func (p *Pool) admit(ctx context.Context, c *pgx.Conn) (bool, error) {
	if ctx.Value(probeKey{}) != nil {
		return true, nil // Probe checks the connection itself
	}
	t, routed := p.cfg.Target(ctx)
	if !routed {
		return true, nil
	}
	v, _ := p.conns.Load(c)
	ci, _ := v.(*conn)
	var res Check
	switch {
	case ci == nil:
		res = CheckBehind // the server did not say who it is
	case ci.pooled || p.servers.pooled.Load():
		res = p.checkInTx(ctx, c, ci, t)
	default:
		res = p.checkDirect(ctx, c, ci, t)
	}
	p.cfg.Events.Checked(ctx, res)
	if res != CheckBehind {
		p.behind.reset()
		return true, nil
	}
	if t.Attempt == nil {
		return false, nil
	}
	if t.Attempt.refusals.Add(1) >= p.maxRefusals {
		t.Attempt.Fail()
		return false, fmt.Errorf("%w (database %q, replica %q)", ErrReplicaBehind, p.cfg.Database, p.cfg.Replica)
	}
	return false, nil
}

// checkDirect checks a direct connection: free on a server known to have
// replayed what the job needs, one query on another.
func (p *Pool) checkDirect(ctx context.Context, c *pgx.Conn, ci *conn, t Target) Check {
	if !ci.run.IsZero() && ci.run == t.Server {
		return CheckSameServer
	}
	if !ci.run.IsZero() && p.servers.knows(ci.run, t.Need, p.caughtUp) {
		p.servers.touch(ci.run, p.cfg.Now()) // still behind the pool, for Lift
		return CheckSameServer
	}
	rd, err := pgwal.ReadReplica(ctx, c, pgwal.Backend)
	if err != nil || ci.system == 0 {
		return CheckBehind
	}
	if rd.BackendPID != ci.pid {
		p.markPooled(true)
		return CheckBehind // which server the next statement reaches, nothing says
	}
	got := replayedOf(rd, ci.system)
	p.servers.learn(ci.run, got, p.cfg.Now())
	if !p.caughtUp(t.Need, got) {
		return CheckBehind
	}
	p.warnOther.Do(func() {
		p.logAt(slog.LevelWarn, "caughtup: the replica pool reaches a server other than the one the decision judged (a balanced endpoint, a DNS move or a restart): "+TopologyBalanced.Cost()+" (logged at most once a minute)")
	})
	return CheckVerified
}

// checkInTx opens the transaction a pooled connection's reads will run in,
// reading the position of the server it binds in the same round trip.
// The transaction ends when the connection is released.
func (p *Pool) checkInTx(ctx context.Context, c *pgx.Conn, ci *conn, t Target) Check {
	ok, err := p.beginVerified(ctx, c.PgConn(), t.Need)
	ci.inTx = c.PgConn().TxStatus() != 'I'
	if err != nil || !ok {
		// The connection is destroyed with its transaction open: a pooler
		// then drops that server connection, and the next one it opens
		// goes through the balancer again.
		return CheckBehind
	}
	ci.held, ci.need, ci.attempt = true, t.Need, t.Attempt
	return CheckInTransaction
}

// beginVerified opens a transaction on c, reads its server's position in
// it, learns it, and reports whether the server has replayed need.
func (p *Pool) beginVerified(ctx context.Context, c *pgconn.PgConn, need position.Entry) (bool, error) {
	rd, err := pgwal.BeginReadReplica(ctx, c, pgwal.Control|pgwal.Status)
	if err != nil {
		return false, err
	}
	got := replayedOf(rd, rd.Control.SystemID)
	p.servers.learn(runOf(rd), got, p.cfg.Now())
	return p.caughtUp(need, got), nil
}

// rollbackTimeout bounds the ROLLBACK that ends a pooled connection's
// checked transaction at release; a connection that cannot end it is
// destroyed.
const rollbackTimeout = 5 * time.Second

// released ends the checked transaction of a pooled connection, if the
// handler left it open, before the pool decides whether to keep the
// connection (it destroys one in a transaction).
func (p *Pool) released(c *pgx.Conn) {
	v, _ := p.conns.Load(c)
	ci, _ := v.(*conn)
	if ci == nil {
		return
	}
	inTx := ci.inTx
	ci.held, ci.inTx, ci.need, ci.attempt = false, false, position.Entry{}, nil
	if !inTx {
		return
	}
	pc := c.PgConn()
	if pc.IsClosed() || pc.IsBusy() || pc.TxStatus() == 'I' {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), rollbackTimeout)
	defer cancel()
	_, _ = pc.Exec(ctx, "ROLLBACK").ReadAll()
}

// guard runs before each statement on a connection: a pooled connection
// that a routed acquire holds, whose checked transaction the handler ended
// (its own COMMIT), is checked again before the statement runs, in a new
// transaction; one found behind is closed, so the statement fails instead
// of reading another server unchecked, and the job is marked failed.
func (p *Pool) guard(ctx context.Context, c *pgx.Conn) {
	v, _ := p.conns.Load(c)
	ci, _ := v.(*conn)
	if ci == nil || !ci.held {
		return
	}
	pc := c.PgConn()
	if pc.IsClosed() || pc.TxStatus() != 'I' {
		return // still in the checked transaction (or one inside it)
	}
	ok, err := p.beginVerified(ctx, pc, ci.need)
	ci.inTx = pc.TxStatus() != 'I'
	if err == nil && ok {
		p.cfg.Events.Checked(ctx, CheckInTransaction)
		return
	}
	p.cfg.Events.Checked(ctx, CheckBehind)
	ci.attempt.Fail()
	closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = pc.Close(closeCtx)
}

// failed records a failed acquire or a broken connection that is not the
// caller's doing: the replica is left out, and the job's attempt marked.
func (p *Pool) failed(ctx context.Context, failure error) {
	if ctx.Value(reprobeKey{}) != nil || ctx.Err() != nil || errors.Is(failure, context.Canceled) || errors.Is(failure, context.DeadlineExceeded) {
		return
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	var err error
	reason := ReasonBehind
	t, routed := p.cfg.Target(ctx)
	switch {
	case errors.Is(failure, ErrReplicaBehind):
		err = failure
	case routed && (t.Attempt.Refused() || t.Attempt.Failed()):
		// pgxpool gives up after MaxConns+1 tries of its own (refusals,
		// expired or failed-ping connections alike), with an error of its
		// own; a statement fails on the connection guard closed for
		// reaching a server behind the job: the connections this job was
		// given back, or the guard, say why.
		err = fmt.Errorf("%w (database %q, replica %q): %w", ErrReplicaBehind, p.cfg.Database, p.cfg.Replica, failure)
	case errors.As(failure, &ce), errors.As(failure, &ne), errors.Is(failure, io.ErrUnexpectedEOF), errors.Is(failure, io.EOF), errors.Is(failure, net.ErrClosed):
		err, reason = fmt.Errorf("%w: %w", ErrUnreachable, failure), ReasonUnreachable
	default:
		return // the application's hook refused, or the like
	}
	if routed {
		t.Attempt.Fail()
	}
	if reason == ReasonBehind && !p.behind.failed() {
		// A balancer or pooler over several servers hands a job only
		// lagging ones now and then while others behind it have the
		// token: that job is routed again (Attempt.Failed), and the pool,
		// which serves the next ones, stays in the decisions.
		return
	}
	p.fail(reason, err)
}

// fail records one failure of the replica.
func (p *Pool) fail(reason Reason, err error) {
	tr, until := p.health.fail(p.cfg.Now(), reason, err)
	p.cfg.Gen.Add(1)
	if tr == excludedNow {
		p.cfg.Events.Excluded(reason, err)
		p.logAt(slog.LevelWarn, "caughtup: this process's handlers cannot use the replica; it is left out of this router's decisions, for longer after each failure in a row, and used again once it answers",
			slog.String("caughtup.reason", reason.String()), slog.Time("until", until), slog.Any("error", err))
	}
}

func (p *Pool) readmitted() {
	p.cfg.Gen.Add(1)
	p.cfg.Events.Readmitted()
	p.logAt(slog.LevelInfo, "caughtup: the replica is used again by this router's decisions")
}

// Excluded reports whether the replica is out of this process's decisions
// at now, with the error a snapshot shows for it, and until when at most
// the answer holds (zero: until Gen changes). An exclusion for
// unreachability that ran out starts a re-probe, and holds until it
// succeeds.
func (p *Pool) Excluded(now time.Time) (excluded bool, err error, validUntil time.Time) {
	excluded, err, reprobe, tr := p.health.state(now)
	if tr == readmitted {
		p.readmitted()
	}
	if reprobe {
		p.reprobe()
	}
	if excluded {
		validUntil = p.health.excludedUntil()
		if !validUntil.After(now) {
			validUntil = time.Time{} // re-probing: until it ends
		}
	}
	return excluded, err, validUntil
}

// reprobeTimeout bounds a re-probe's connection and query.
const reprobeTimeout = 5 * time.Second

// reprobe connects once, in the background, to see whether the replica
// is back.
func (p *Pool) reprobe() {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		ctx, cancel := context.WithTimeout(context.WithValue(p.ctx, reprobeKey{}, true), reprobeTimeout)
		defer cancel()
		c, err := p.pool.Acquire(ctx) // not routed: admitted unchecked
		if err == nil {
			err = c.Ping(ctx)
			c.Release()
		}
		if p.ctx.Err() != nil {
			return
		}
		if err != nil {
			until := p.health.reprobeFailed(p.cfg.Now(), fmt.Errorf("%w: %w", ErrUnreachable, err))
			p.cfg.Gen.Add(1)
			p.logAt(slog.LevelDebug, "caughtup: the replica is still unreachable from this process's handlers", slog.Time("until", until), slog.Any("error", err))
			return
		}
		if p.health.succeeded() == readmitted {
			p.readmitted()
		}
	}()
}

// poolHooks are the handler pool's tracer: acquires that fail, statements
// on pooled connections, queries on broken connections and releases.
type poolHooks struct{ p *Pool }

var (
	_ pgxpool.AcquireTracer = poolHooks{}
	_ pgxpool.ReleaseTracer = poolHooks{}
	_ pgx.QueryTracer       = poolHooks{}
	_ pgx.BatchTracer       = poolHooks{}
)

func (h poolHooks) TraceQueryStart(ctx context.Context, c *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	h.p.guard(ctx, c)
	return ctx
}

// TraceQueryEnd: a query that failed because its connection broke (the
// server, or what stands before it, went away under an idle connection)
// counts as a failed acquire: the next connection would have to be a new
// one, and may not come.
func (h poolHooks) TraceQueryEnd(ctx context.Context, c *pgx.Conn, data pgx.TraceQueryEndData) {
	if data.Err != nil && c != nil && c.IsClosed() {
		h.p.failed(ctx, data.Err)
	}
}

func (h poolHooks) TraceBatchStart(ctx context.Context, c *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	h.p.guard(ctx, c)
	return ctx
}

func (poolHooks) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (h poolHooks) TraceBatchEnd(ctx context.Context, c *pgx.Conn, data pgx.TraceBatchEndData) {
	if data.Err != nil && c != nil && c.IsClosed() {
		h.p.failed(ctx, data.Err)
	}
}

func (poolHooks) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	return ctx
}

func (h poolHooks) TraceAcquireEnd(ctx context.Context, _ *pgxpool.Pool, data pgxpool.TraceAcquireEndData) {
	if data.Err != nil {
		h.p.failed(ctx, data.Err)
	}
}

func (h poolHooks) TraceRelease(_ *pgxpool.Pool, data pgxpool.TraceReleaseData) {
	h.p.released(data.Conn)
}
