package caughtuphttp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// Middleware routes each request's reads like a job's and carries the
// session's token to the client and back. Build it once with New and wrap
// handlers with Handler; it is safe for concurrent use.
type Middleware struct {
	router *consume.Router
	cfg    Config
	codec  *codec
	met    *metrics
	// databases are the router's, sorted: the ones a request without a
	// token for them may read from any caught-up replica.
	databases []string
	// staleness and routerNow are the router's, for judging whether its
	// primary's epoch is known now.
	staleness time.Duration
	routerNow func() time.Time

	// floor is the last floorOf, for the requests without a session.
	floor atomic.Pointer[floor]
	// sources maps a route to its Job.Source (sourceOf); copied on write.
	sources   atomic.Pointer[map[string]string]
	sourcesMu sync.Mutex

	// warnRejected samples the ignored values by result and reason, so
	// that a flood logs when the cap runs out, not only when it starts.
	warnRejected    [numResults][numReasons]*rate.Sometimes
	warnLate        rate.Sometimes
	warnUnavailable rate.Sometimes
	warnSeal        rate.Sometimes
}

// Degraded input tends to come in floods (a rotated-out key logs everyone
// out at once): the metrics count each request, the log samples the first
// few of each kind, then one every warnInterval.
const (
	warnFirst    = 3
	warnInterval = 10 * time.Second
)

// New returns the middleware for router's pools. Its errors wrap
// ErrInvalidConfig.
func New(router *consume.Router, cfg Config) (*Middleware, error) {
	if router == nil {
		return nil, fmt.Errorf("%w: New needs the process's *consume.Router", ErrInvalidConfig)
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rc := router.Config()
	if err := cfg.validateFor(rc); err != nil {
		return nil, err
	}
	met, err := newMetrics(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	m := &Middleware{
		router:          router,
		cfg:             cfg,
		codec:           newCodec(cfg.Keys, rc.ClockSkewTolerance),
		met:             met,
		staleness:       rc.Tracker.StalenessBound,
		routerNow:       rc.Now,
		warnLate:        rate.Sometimes{First: warnFirst, Interval: warnInterval},
		warnUnavailable: rate.Sometimes{First: warnFirst, Interval: warnInterval},
		warnSeal:        rate.Sometimes{First: warnFirst, Interval: warnInterval},
	}
	for name := range rc.Databases {
		m.databases = append(m.databases, name)
	}
	slices.Sort(m.databases)
	m.sources.Store(&map[string]string{})
	for i := range m.warnRejected {
		for j := range m.warnRejected[i] {
			m.warnRejected[i][j] = &rate.Sometimes{First: warnFirst, Interval: warnInterval}
		}
	}
	return m, nil
}

// Handler wraps next: each request is routed once before next runs, with
// the pools chosen in its context (consume.DB, consume.Pool,
// consume.SQLDB), and the token of next's writes goes back to the client
// with the response header.
//
// The token is set when next first writes the header or the body, or
// flushes (through the ResponseWriter it was given, or an
// http.ResponseController on it), or when it returns without writing.
// Writes made after that cannot reach the client: they are counted
// (caughtup.http.tokens.late) and logged. The ResponseWriter next gets
// unwraps (Unwrap) to the one Handler got, so http.ResponseController
// reaches deadlines, full duplex and hijacking; it also implements
// http.Flusher and http.Hijacker itself, the two that code still asserts.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(next, w, r)
	})
}

// carried is what the request brought.
type carried struct {
	tok        position.Token // verified; zero when none or rejected
	fromCookie bool           // the value came in the cookie (which a rejection clears)
	rejected   *RejectedError
	// foreign are the databases whose entry in tok names another cluster
	// than the router's primary (ReasonOtherCluster), found before
	// routing.
	foreign []string
	// capped: the rejected value, or the foreign entries, found the
	// router's fallback cap spent; the request reads without them.
	capped bool
}

// read takes the session's value from the header (when configured and
// present) or the cookie.
func (m *Middleware) read(r *http.Request, now time.Time) carried {
	var value string
	fromCookie := false
	if m.cfg.Header != "" {
		value = r.Header.Get(m.cfg.Header)
	}
	if value == "" {
		value, fromCookie = cookieValue(r.Header, m.cfg.Cookie)
	}
	if value == "" {
		return carried{}
	}
	o, err := m.codec.open(value, now)
	if err != nil {
		return carried{fromCookie: fromCookie, rejected: asRejected(err)}
	}
	return carried{tok: o.tok, fromCookie: fromCookie}
}

// jobToken is the token a request is routed with. A rejected value that
// the fallback cap admitted gives none: the request reads the primary
// (consume.OutcomePrimaryNoToken), as a job whose token is unreadable
// does, charged by admit. Past the cap, a rejected value counts as none
// at all, and foreign entries as absent. Otherwise every database of the
// router that the session's token does not name gets an entry at position
// 0 of the primary's current epoch: the session wrote nothing there that
// the client knows of, so any replica the router may use serves it.
// Without those entries the router would read every such database from
// the primary (an unlisted database is read there), and a request without
// a cookie, the usual case, would never read a replica. A database whose
// primary the tracker has not observed within its staleness bound gets no
// entry and reads the primary: its epoch is not known to be current.
func (m *Middleware) jobToken(in carried, snap *replay.Snapshot, now time.Time) position.Token {
	if in.rejected != nil && !in.capped {
		return position.Token{}
	}
	if in.capped && in.foreign != nil {
		in.tok = without(in.tok, in.foreign)
	}
	if in.tok.IsZero() {
		// A request without a session: the floor of every database whose
		// epoch is current, the same for every such request on snap.
		if floor := m.floorOf(snap); len(floor) > 0 {
			return position.Token{Entries: floor, CapturedAt: now}
		}
		return in.tok
	}
	var floor []position.Entry
	cutoff := m.routerNow().Add(-m.staleness)
	for _, db := range m.databases {
		if _, named := in.tok.Entry(db); named {
			continue
		}
		if ep, ok := currentEpoch(snap, db, cutoff); ok {
			floor = append(floor, position.Entry{Database: db, Epoch: ep, LSN: 0, Source: position.SourceUnknown})
		}
	}
	if len(floor) == 0 {
		return in.tok
	}
	return in.tok.Merge(position.Token{Entries: floor, CapturedAt: now})
}

// floor is the token entries of a request without a session, kept for
// the snapshot they were made from: which databases get one depends on
// snap and on the clock (currentEpoch), so the entries are reused while
// both give the same databases.
type floor struct {
	snap    *replay.Snapshot
	current []bool // per m.databases: has an entry
	entries []position.Entry
}

// floorOf returns jobToken's entries for a token that names no database:
// one per database whose primary's epoch is current in snap. They are
// shared by the requests that get them: read them, do not modify them
// (Merge and the Router copy).
func (m *Middleware) floorOf(snap *replay.Snapshot) []position.Entry {
	cutoff := m.routerNow().Add(-m.staleness)
	f := m.floor.Load()
	if f != nil && f.snap == snap {
		same := true
		for i, db := range m.databases {
			if _, ok := currentEpoch(snap, db, cutoff); ok != f.current[i] {
				same = false
				break
			}
		}
		if same {
			return f.entries
		}
	}
	f = &floor{snap: snap, current: make([]bool, len(m.databases))}
	for i, db := range m.databases {
		if ep, ok := currentEpoch(snap, db, cutoff); ok {
			f.current[i] = true
			f.entries = append(f.entries, position.Entry{Database: db, Epoch: ep, LSN: 0, Source: position.SourceUnknown})
		}
	}
	f.entries = slices.Clip(f.entries)
	m.floor.Store(f)
	return f.entries
}

func (m *Middleware) serve(next http.Handler, w http.ResponseWriter, r *http.Request) {
	now := m.cfg.Now()
	route := m.cfg.Route(r)
	in := m.read(r, now)
	snap := m.router.Snapshot()
	m.admit(r, route, &in, snap)
	// What the request needs lives in one allocation: the session's
	// bookkeeping, the ResponseWriter and the two contexts below.
	q := &request{}
	// One session per request collects the token of every write the
	// handler makes through enqueue (InTx, Commit, AfterWrite), even from
	// contexts it does not pass back up.
	ctx := enqueue.WithSession(r.Context())
	job := consume.Job{
		Token:  m.jobToken(in, snap, now),
		Policy: m.cfg.Policy,
		Source: m.sourceOf(route),
		// No queue to put the request back on: the router waits, then
		// reads the primary under the cap, and while the cap is spent
		// holds the request for a replica or the cap, up to MaxWait.
		NoDefer: true,
		Hold:    true,
	}
	// MaxWait bounds the routing, not the handler: Route's context has the
	// deadline, the handler's context has the request's cancellation and
	// Route's values (valuesOf).
	// time.Now, not Config.Now: timers run on the real clock.
	q.bounded = routeContext{parent: ctx, deadline: time.Now().Add(m.cfg.MaxWait)}
	routed, d, err := m.router.Route(&q.bounded, job)
	q.bounded.release()
	q.session = session{m: m, w: w, ctx: &q.handler, in: in}
	if err != nil {
		if r.Context().Err() != nil {
			return // the client is gone; nobody reads an answer
		}
		m.met.unavailable.Add(r.Context(), 1)
		m.warnUnavailable.Do(func() {
			m.cfg.Logger.WarnContext(r.Context(), "caughtup: request not routed within MaxWait; answered unavailable",
				slog.String("route", route), slog.String("caughtup.reason", d.Reason.String()), slog.Any("error", err))
		})
		if in.rejected != nil && in.fromCookie {
			q.session.ctx = ctx
			q.session.setCookie("", -1)
		}
		m.cfg.Unavailable(w, r, err)
		return
	}
	q.handler = valuesOf{Context: ctx, values: routed}
	s := &q.session
	s.drop = slices.Clip(in.foreign)
	s.before, _ = enqueue.TokenFrom(s.ctx)
	if late := s.foreign(d); late != nil {
		// The router judged these by the replicas' epochs (its view of the
		// primary's had none): they read the primary, uncharged, as the
		// databases of a request without a session then do.
		m.rejected(r, route, ReasonOtherCluster, resultPrimary, slog.Any("databases", late))
	}
	q.w = responseWriter{ResponseWriter: w, s: s}
	next.ServeHTTP(&q.w, r.WithContext(s.ctx))
	s.finish(r.Context(), route)
}

// request is what serve keeps for one request, in one allocation.
type request struct {
	session session
	w       responseWriter
	// bounded is Route's context; handler the handler's.
	bounded routeContext
	handler valuesOf
}

// maxSources bounds the Job.Source strings kept by route (sourceOf).
const maxSources = 1024

// sourceOf is "http " + route, the job's Source, without building it for
// every request: routes are few (a pattern, a method), and a Config.Route
// that names more than maxSources gets them built per request.
func (m *Middleware) sourceOf(route string) string {
	sources := *m.sources.Load()
	if s, ok := sources[route]; ok {
		return s
	}
	s := "http " + route
	if len(sources) < maxSources {
		m.sourcesMu.Lock()
		cur := *m.sources.Load()
		if _, ok := cur[route]; !ok && len(cur) < maxSources {
			next := make(map[string]string, len(cur)+1)
			maps.Copy(next, cur)
			next[route] = s
			m.sources.Store(&next)
		}
		m.sourcesMu.Unlock()
	}
	return s
}

// admit decides what a rejected value, or entries naming another
// cluster, may read, and counts and logs it. Such a value asks for the
// primary, which a request without one would not read, and any client can
// send one: each such request charges that read to the router's fallback
// cap (Router.AllowFallback), so that they never read the primary more
// often than the cap allows. Past the cap the request reads as one
// without the value (without those entries): from any caught-up replica,
// the answer a request without a cookie gets, and never more. A session
// that was real, lost to a retired key or a clock ahead, is then read
// without its last writes; within the cap the primary serves it, the
// safe answer while such values are few.
func (m *Middleware) admit(r *http.Request, route string, in *carried, snap *replay.Snapshot) {
	if in.rejected == nil {
		in.foreign = foreignEntries(in.tok, snap)
		if in.foreign == nil {
			return
		}
		in.capped = !m.router.AllowFallback(r.Context(), in.foreign...)
		m.rejected(r, route, ReasonOtherCluster, resultOf(in.capped), slog.Any("databases", in.foreign))
		return
	}
	in.capped = !m.router.AllowFallback(r.Context(), m.databases...)
	m.rejected(r, route, in.rejected.Reason, resultOf(in.capped), slog.String("error", in.rejected.Error()))
}

// rejected counts and logs, sampled, one ignored value.
func (m *Middleware) rejected(r *http.Request, route string, reason Reason, res result, detail slog.Attr) {
	m.met.reject(r.Context(), reason, res)
	m.warnRejected[res][reason].Do(func() {
		msg := "caughtup: session token ignored; the request reads the primary, charged to the fallback cap"
		switch {
		case res == resultSessionLess:
			msg = "caughtup: session token ignored and the fallback cap is spent; the request reads as one without a session (any caught-up replica)"
		case reason == ReasonOtherCluster:
			msg = "caughtup: session token names another cluster's position; the request reads the primary there, and the client's next token leaves it out"
		}
		m.cfg.Logger.WarnContext(r.Context(), msg,
			slog.String("route", route), slog.String("caughtup.reason", reason.String()), slog.String("caughtup.result", res.String()), detail)
	})
}

// foreignEntries are the router's databases whose entry in tok belongs to
// another cluster than the primary the tracker knows (another system
// identifier), or to no known one (an epoch merged unknown): no server
// of this cluster can be compared with them (position's rule, as the
// router applies it). A database whose primary the tracker has not
// observed is left to the router, which judges it by the replicas
// (session.foreign).
func foreignEntries(tok position.Token, snap *replay.Snapshot) []string {
	var out []string
	for _, e := range tok.Entries {
		ds := snap.Database(e.Database)
		if ds == nil {
			continue // not the router's: nothing reads it
		}
		if len(ds.Replicas) == 0 || (!e.Epoch.IsZero() && ds.Primary.Epoch.IsZero()) {
			continue // read on the primary by every request; or the router's to judge
		}
		primary := position.Replayed{Epoch: ds.Primary.Epoch, LSN: math.MaxUint64}
		if c := e.Compare(primary, nil); c.Status == position.NotComparable &&
			(c.Reason == position.OtherSystem || c.Reason == position.UnknownEpoch) && !slices.Contains(out, e.Database) {
			out = append(out, e.Database)
		}
	}
	return out
}

// without is tok without the entries of databases.
func without(tok position.Token, databases []string) position.Token {
	var keep []position.Entry
	for _, e := range tok.Entries {
		if !slices.Contains(databases, e.Database) {
			keep = append(keep, e)
		}
	}
	if keep == nil {
		return position.Token{}
	}
	return position.Token{Entries: keep, CapturedAt: tok.CapturedAt}
}

// currentEpoch is db's primary's epoch in snap, if it was observed at or
// after cutoff.
func currentEpoch(snap *replay.Snapshot, db string, cutoff time.Time) (position.Epoch, bool) {
	ds := snap.Database(db)
	if ds == nil || ds.Primary.Epoch.IsZero() || ds.Primary.ObservedAt.Before(cutoff) {
		return position.Epoch{}, false
	}
	return ds.Primary.Epoch, true
}

// valuesOf is a context with one context's cancellation (Deadline, Done,
// Err) and another's values. Route's context is the request's with
// MaxWait's deadline; the context Route returns is built on it, and the
// handler must not inherit that deadline, so the handler gets the
// request's cancellation with the returned context's values. Values never
// reach the bounded context itself: context.Cause and the context
// package's parent lookups find the request's own cancellation, which
// agrees with Done.
type valuesOf struct {
	context.Context
	values context.Context
}

func (c valuesOf) Value(key any) any { return c.values.Value(key) }

func (c valuesOf) String() string {
	return fmt.Sprintf("%v.WithValuesOf(%v)", c.Context, c.values)
}

// routeContext is the context Route gets: parent (the request's context
// with its enqueue session) with MaxWait's deadline. context.WithTimeout
// would start a timer for every request, and most requests are routed
// without waiting: the timer (a context.WithDeadline of parent) is made
// only when something waits on the context, through Done or AfterFunc
// (a context derived from it), or asks Err past the deadline. release
// ends it once Route has returned: as for a cancelled context.WithTimeout,
// Done is then closed and Err is context.Canceled (or the deadline's, or
// parent's, error if that came first). Values are parent's, so
// context.Cause and the context package's parent lookups find the
// request's own cancellation, as they did through valuesOf.
type routeContext struct {
	parent   context.Context
	deadline time.Time

	mu       sync.Mutex
	timed    context.Context // nil until armed
	cancel   context.CancelFunc
	released bool
}

// arm returns the context that carries the deadline, making it on first
// use.
func (c *routeContext) arm() context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timed == nil {
		c.timed, c.cancel = context.WithDeadline(c.parent, c.deadline)
		if c.released {
			c.cancel()
		}
	}
	return c.timed
}

// release is the cancel of context.WithTimeout.
func (c *routeContext) release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.released = true
	if c.cancel != nil {
		c.cancel()
	}
}

func (c *routeContext) Deadline() (time.Time, bool) {
	if d, ok := c.parent.Deadline(); ok && d.Before(c.deadline) {
		return d, true
	}
	return c.deadline, true
}

func (c *routeContext) Done() <-chan struct{} { return c.arm().Done() }

func (c *routeContext) Err() error {
	c.mu.Lock()
	quiet := c.timed == nil && !c.released
	c.mu.Unlock()
	if quiet && c.parent.Err() == nil && time.Now().Before(c.deadline) {
		return nil // nothing has ended: Done, once made, would be open
	}
	return c.arm().Err()
}

func (c *routeContext) Value(key any) any { return c.parent.Value(key) }

// AfterFunc lets a context derived from c (context.WithCancel and the
// like) be cancelled with it without a goroutine of its own, as from a
// context.WithDeadline.
func (c *routeContext) AfterFunc(f func()) (stop func() bool) {
	return context.AfterFunc(c.arm(), f)
}

func (c *routeContext) String() string {
	return fmt.Sprintf("%v.WithDeadline(%v)", c.parent, c.deadline)
}

// errSeal wraps a token that could not be written into a value.
var errSeal = errors.New("caughtup/http: the session's token cannot be carried")
