package caughtuphttp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// env is one test's database on the shared cluster, a router over it and
// an HTTPS server whose handlers write on the primary and read from the
// pool the middleware chose.
type env struct {
	c       *pgtest.Cluster
	primary *pgxpool.Pool
	// replicas are the application's own pools, for handlers that bypass
	// the middleware (benchmarks).
	replicas []*pgxpool.Pool
	router   *consume.Router
	reader   *sdkmetric.ManualReader
	mw       *Middleware
	srv      *httptest.Server
	cfg      Config
	rcfg     consume.Config
	// inflight counts requests in the middleware, so that a test can wait
	// for what it records after a handler returns.
	inflight sync.WaitGroup
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type mods struct {
	router func(*consume.Config)
	http   func(*Config)
}

func setup(t testing.TB, m mods) *env {
	t.Helper()
	ctx := ctxT(t)
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	e := &env{c: c, reader: sdkmetric.NewManualReader()}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(e.reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	var err error
	e.primary, err = c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	t.Cleanup(e.primary.Close)
	_, err = e.primary.Exec(ctx, "CREATE TABLE items (id bigserial PRIMARY KEY, v text)")
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	var reps []replay.Replica
	for i, n := range c.Replicas() {
		p, err := n.Pool(ctx, db)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		reps = append(reps, replay.Replica{Name: "r" + strconv.Itoa(i+1), Pool: p})
		e.replicas = append(e.replicas, p)
	}
	e.rcfg = consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: e.primary, Replicas: reps}},
		Logger:        testLogger(t),
		MeterProvider: mp,
		WaitBudget:    100 * time.Millisecond,
		Tracker:       replay.TrackerConfig{PollInterval: 50 * time.Millisecond},
	}
	if m.router != nil {
		m.router(&e.rcfg)
	}
	e.router, err = consume.NewRouter(ctx, e.rcfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, e.router.Close()) })
	key, err := feed.GenerateKey("test-1")
	require.NoError(t, err)
	e.cfg = Config{Keys: []feed.Key{key}, MeterProvider: mp, Logger: testLogger(t)}
	if m.http != nil {
		m.http(&e.cfg)
	}
	e.mw, err = New(e.router, e.cfg)
	require.NoError(t, err)
	e.cfg = e.cfg.WithDefaults()
	h := e.mw.Handler(e.mux())
	e.srv = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.inflight.Add(1)
		defer e.inflight.Done()
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// read is what GET /items/{id} answers.
type read struct {
	Found   bool   `json:"found"`
	Replica string `json:"replica"` // "" for the primary
	Outcome string `json:"outcome"`
	Reason  string `json:"reason"`
}

func (e *env) mux() *http.ServeMux {
	mux := http.NewServeMux()
	insert := func(ctx context.Context) (int64, error) {
		var id int64
		// The returned context is dropped on purpose: the middleware's
		// session still collects the write's token.
		_, err := enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, "INSERT INTO items (v) VALUES ('x') RETURNING id").Scan(&id)
		})
		return id, err
	}
	mux.HandleFunc("POST /items", func(w http.ResponseWriter, r *http.Request) {
		id, err := insert(r.Context())
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		fmt.Fprint(w, id)
	})
	mux.HandleFunc("GET /items/{id}", func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var n int
		if err := consume.DB(ctx, "main").QueryRow(ctx, "SELECT count(*) FROM items WHERE id = $1", r.PathValue("id")).Scan(&n); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		d, _ := consume.DecisionFrom(ctx)
		dd, _ := d.Database("main")
		_ = json.NewEncoder(w).Encode(read{Found: n == 1, Replica: dd.Replica, Outcome: d.Outcome.String(), Reason: d.Reason.String()})
	})
	// The token a job enqueued here would carry.
	mux.HandleFunc("GET /token", func(w http.ResponseWriter, r *http.Request) {
		tok, _ := enqueue.TokenFrom(r.Context())
		fmt.Fprint(w, tok.String())
	})
	// Writes after the header is out: too late for the cookie.
	mux.HandleFunc("POST /late", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
		if _, err := insert(r.Context()); err != nil {
			panic(err)
		}
	})
	// Writes, then flushes through a ResponseController.
	mux.HandleFunc("POST /flush", func(w http.ResponseWriter, r *http.Request) {
		id, err := insert(r.Context())
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		rc := http.NewResponseController(w)
		if err := rc.SetWriteDeadline(time.Now().Add(time.Minute)); err != nil {
			http.Error(w, "SetWriteDeadline: "+err.Error(), 500)
			return
		}
		if err := rc.Flush(); err != nil {
			panic(err)
		}
		fmt.Fprint(w, id)
	})
	// Writes, then takes the connection over.
	mux.HandleFunc("POST /hijack", func(w http.ResponseWriter, r *http.Request) {
		if _, err := insert(r.Context()); err != nil {
			panic(err)
		}
		conn, buf, err := w.(http.Hijacker).Hijack()
		if err != nil {
			panic(err)
		}
		defer conn.Close()
		_, _ = buf.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
		_ = buf.Flush()
	})
	// Sends early hints, then writes, then answers.
	mux.HandleFunc("POST /hints", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		id, err := insert(r.Context())
		if err != nil {
			panic(err)
		}
		fmt.Fprint(w, id)
	})
	// Sets the Cache-Control given in cc, writes when POSTed, answers.
	cached := func(w http.ResponseWriter, r *http.Request) {
		if cc := r.URL.Query()["cc"]; cc != nil {
			w.Header()["Cache-Control"] = cc
		}
		if r.Method == http.MethodPost {
			if _, err := insert(r.Context()); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
		}
		fmt.Fprint(w, "ok")
	}
	mux.HandleFunc("POST /cached", cached)
	mux.HandleFunc("GET /cached", cached)
	// Writes and returns without writing anything.
	mux.HandleFunc("POST /silent", func(w http.ResponseWriter, r *http.Request) {
		if _, err := insert(r.Context()); err != nil {
			panic(err)
		}
	})
	return mux
}

// client is a browser: a cookie jar of its own.
func (e *env) client(t testing.TB) *http.Client {
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	return &http.Client{Transport: e.srv.Client().Transport, Jar: jar}
}

func (e *env) do(t testing.TB, c *http.Client, req *http.Request) (*http.Response, string) {
	t.Helper()
	resp, err := c.Do(req)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	e.inflight.Wait() // a hijacked connection's answer can come before the handler returns
	return resp, string(body)
}

func (e *env) request(t testing.TB, method, path string, cookie string) *http.Request {
	req, err := http.NewRequestWithContext(ctxT(t), method, e.srv.URL+path, nil)
	require.NoError(t, err)
	if cookie != "" {
		req.AddCookie(&http.Cookie{Name: e.cfg.Cookie, Value: cookie})
	}
	return req
}

func (e *env) post(t testing.TB, c *http.Client) (int64, *http.Response) {
	t.Helper()
	resp, body := e.do(t, c, e.request(t, http.MethodPost, "/items", ""))
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	id, err := strconv.ParseInt(body, 10, 64)
	require.NoError(t, err)
	return id, resp
}

func (e *env) get(t testing.TB, c *http.Client, id int64, cookie string) (read, *http.Response) {
	t.Helper()
	resp, body := e.do(t, c, e.request(t, http.MethodGet, "/items/"+strconv.FormatInt(id, 10), cookie))
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	var rd read
	require.NoError(t, json.NewDecoder(strings.NewReader(body)).Decode(&rd))
	return rd, resp
}

// cookie returns the session cookie resp set, or nil.
func (e *env) cookie(resp *http.Response) *http.Cookie {
	for _, c := range resp.Cookies() {
		if c.Name == e.cfg.Cookie {
			return c
		}
	}
	return nil
}

// token opens a value the middleware issued.
func (e *env) token(t testing.TB, value string) position.Token {
	t.Helper()
	o, err := e.mw.codec.open(value, time.Now())
	require.NoError(t, err)
	return o.tok
}

func pauseAll(t testing.TB, c *pgtest.Cluster) {
	t.Helper()
	for _, n := range c.Replicas() {
		require.NoError(t, n.PauseReplay(ctxT(t)))
	}
	t.Cleanup(func() { resumeAll(t, c) })
}

func resumeAll(t testing.TB, c *pgtest.Cluster) {
	for _, n := range c.Replicas() {
		require.NoError(t, n.ResumeReplay(context.Background()))
	}
}

// caughtUp waits until the router sees every replica past tok, so that
// the next request's decision does not depend on a wait's timing.
func (e *env) caughtUp(t testing.TB, tok position.Token) {
	t.Helper()
	ctx := ctxT(t)
	require.NoError(t, e.c.WaitReplicasCaughtUp(ctx))
	entry, ok := tok.Entry("main")
	require.True(t, ok)
	for {
		s := e.router.Snapshot()
		ds := s.Database("main")
		all := true
		for _, rs := range ds.Replicas {
			all = all && entry.Compare(rs.Replayed, ds.Primary.History).Status == position.CaughtUp
		}
		if all {
			return
		}
		select {
		case <-s.Changed():
		case <-ctx.Done():
			t.Fatal(errors.New("the router never saw the replicas catch up"))
		}
	}
}

func strconvI(id int64) string { return strconv.FormatInt(id, 10) }
