package caughtuphttp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/testkit/metrictest"
)

// BenchmarkRequest measures what the middleware costs a request that reads
// one row, end to end: a real HTTP client and server over loopback, one
// server serving both sides, the same handler (one point query, its count
// as the body) reached bare at /bare/... and through Handler at
// /routed/..., by the same client with the same concurrency
// (CAUGHTUP_HTTP_BENCH_CONCURRENCY, default 4, pgxpool's MaxConns here)
// on the same keep-alive connections, sending the same cookie.
//
// The two sides read the same servers: the router is given the first
// replicas= replicas, and the bare handler reads the application's pools
// of those replicas, alternating between them as the router does
// (replicas=1 is the like-for-like row; replicas=2 adds the router's
// spread over two standbys, mirrored on the bare side). Each round
// (CAUGHTUP_HTTP_BENCH_ROUNDS, default 20) serves b.N/rounds requests on
// each side, in alternating order, so that load from elsewhere on the
// machine hits both alike; the ratio routed/bare is requests per second
// (1 is as fast as the bare handler): its median, min and max over the
// rounds are reported with both sides' rates and CPU per request (this
// process's: client, server, middleware; not PostgreSQL's), and
// routed/bare-cpu, the ratio of the latter. Short rounds, many of them:
// on a machine whose load changes from second to second, a round's
// ratio spreads widely, and the median of many is what holds still.
//
// "anonymous" requests carry no session value; "session" requests carry
// the value of a write the session made at the start of the round (after
// the router saw the replicas replay it), and read that row. A routed read
// that does not find the row is stale: the benchmark fails on any
// (bare-stale is reported beside it). replica-reads is the share of routed
// requests the router sent to a replica, which the comparison assumes.
//
//	go test -run '^$' -bench BenchmarkRequest -benchtime 40000x ./web/caughtuphttp/
func BenchmarkRequest(b *testing.B) {
	conc := envInt(b, "CAUGHTUP_HTTP_BENCH_CONCURRENCY", 4)
	rounds := envInt(b, "CAUGHTUP_HTTP_BENCH_ROUNDS", 20)
	for _, replicas := range []int{1, 2} {
		b.Run("replicas="+strconv.Itoa(replicas), func(b *testing.B) {
			e := setup(b, mods{router: func(c *consume.Config) {
				db := c.Databases["main"]
				require.GreaterOrEqual(b, len(db.Replicas), replicas, "the shared cluster's replicas")
				db.Replicas = db.Replicas[:replicas]
				c.Databases["main"] = db
			}})
			names := make([]string, replicas)
			for i := range names {
				names[i] = "r" + strconv.Itoa(i+1)
			}
			bare := e.replicas[:replicas]
			var spread atomic.Uint64
			mux := http.NewServeMux()
			mux.HandleFunc("GET /bare/items/{id}", func(w http.ResponseWriter, r *http.Request) {
				readRow(w, r, bare[spread.Add(1)%uint64(len(bare))])
			})
			mux.Handle("GET /routed/items/{id}", e.mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				readRow(w, r, consume.DB(r.Context(), "main"))
			})))
			srv := httptest.NewServer(mux)
			b.Cleanup(srv.Close)
			tr := &http.Transport{MaxIdleConns: 2 * conc, MaxIdleConnsPerHost: 2 * conc}
			b.Cleanup(tr.CloseIdleConnections)
			c := &client{http: &http.Client{Transport: tr}, base: srv.URL, conc: conc}
			browser := e.client(b)
			replicaRoutes := func() (replica, all int64) {
				for _, n := range names {
					replica += metrictest.Sum(b, e.reader, "caughtup.consume.database.routes", attribute.String("caughtup.replica", n))
				}
				return replica, metrictest.Sum(b, e.reader, "caughtup.consume.database.routes")
			}

			// A row every request may read, written before the rounds.
			anonID, resp := e.post(b, browser)
			e.caughtUp(b, e.token(b, e.cookie(resp).Value))

			for _, session := range []bool{false, true} {
				name := "anonymous"
				if session {
					name = "session"
				}
				b.Run(name, func(b *testing.B) {
					rounds := min(rounds, b.N)
					var (
						ratios                []float64
						bareT, routedT        phase
						onReplica, routedReqs int64
					)
					for round := range rounds {
						n := b.N / rounds
						if round == rounds-1 {
							n = b.N - n*(rounds-1)
						}
						id, cookie := anonID, ""
						if session {
							// The session writes; its next requests read that row.
							var resp *http.Response
							id, resp = e.post(b, browser)
							v := e.cookie(resp).Value
							e.caughtUp(b, e.token(b, v))
							cookie = e.cfg.Cookie + "=" + v
						}
						path := "/items/" + strconv.FormatInt(id, 10)
						var bp, rp phase
						routedSide := func() {
							r0, a0 := replicaRoutes()
							rp = c.run(b, "/routed"+path, cookie, n)
							r1, a1 := replicaRoutes()
							onReplica, routedReqs = onReplica+r1-r0, routedReqs+a1-a0
						}
						if round%2 == 0 {
							bp = c.run(b, "/bare"+path, cookie, n)
							routedSide()
						} else {
							routedSide()
							bp = c.run(b, "/bare"+path, cookie, n)
						}
						ratios = append(ratios, bp.wall.Seconds()/rp.wall.Seconds())
						bareT.add(bp)
						routedT.add(rp)
					}
					require.Zero(b, routedT.stale, "routed requests that did not find the session's row")
					slices.Sort(ratios)
					b.ReportMetric(0, "ns/op")
					b.ReportMetric(median(ratios), "routed/bare")
					b.ReportMetric(ratios[0], "routed/bare-min")
					b.ReportMetric(ratios[len(ratios)-1], "routed/bare-max")
					b.ReportMetric(bareT.rate(), "bare-req/s")
					b.ReportMetric(routedT.rate(), "routed-req/s")
					b.ReportMetric(bareT.cpuPerRequest(), "bare-cpu-µs/req")
					b.ReportMetric(routedT.cpuPerRequest(), "routed-cpu-µs/req")
					if routedT.cpu > 0 {
						b.ReportMetric(bareT.cpuPerRequest()/routedT.cpuPerRequest(), "routed/bare-cpu")
					}
					b.ReportMetric(float64(routedT.stale), "stale")
					b.ReportMetric(float64(bareT.stale), "bare-stale")
					b.ReportMetric(float64(onReplica)/float64(max(routedReqs, 1)), "replica-reads")
				})
			}
		})
	}
}

// readRow is BenchmarkRequest's handler on either side: one point query on
// p, its count as the body.
func readRow(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	var n int64
	if err := p.QueryRow(r.Context(), "SELECT count(*) FROM items WHERE id = $1", r.PathValue("id")).Scan(&n); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	_, _ = w.Write(strconv.AppendInt(nil, n, 10))
}

// client sends BenchmarkRequest's requests, conc at a time.
type client struct {
	http *http.Client
	base string
	conc int
}

// phase is what one side's requests took.
type phase struct {
	requests int64
	wall     time.Duration
	cpu      time.Duration
	stale    int64
}

func (p *phase) add(q phase) {
	p.requests += q.requests
	p.wall += q.wall
	p.cpu += q.cpu
	p.stale += q.stale
}

func (p phase) rate() float64 { return float64(p.requests) / p.wall.Seconds() }

func (p phase) cpuPerRequest() float64 {
	return p.cpu.Seconds() * 1e6 / float64(max(p.requests, 1))
}

// run sends n GET requests for path with cookie (a Cookie header's value,
// or ""), conc at a time, and counts the answers that did not find the
// row.
func (c *client) run(b *testing.B, path, cookie string, n int) phase {
	ctx := context.Background()
	var next, stale atomic.Int64
	var first error
	var once sync.Once
	var wg sync.WaitGroup
	start, cpu0 := time.Now(), processCPU()
	for range c.conc {
		wg.Go(func() {
			for next.Add(1) <= int64(n) {
				found, err := c.get(ctx, path, cookie)
				if err != nil {
					once.Do(func() { first = err })
					return
				}
				if !found {
					stale.Add(1)
				}
			}
		})
	}
	wg.Wait()
	p := phase{requests: int64(n), wall: time.Since(start), cpu: processCPU() - cpu0, stale: stale.Load()}
	require.NoError(b, first)
	return p
}

func (c *client) get(ctx context.Context, path, cookie string) (found bool, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+path, nil)
	if err != nil {
		return false, err
	}
	if cookie != "" {
		req.Header.Set("Cookie", cookie)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return false, err
	}
	body, err := io.ReadAll(resp.Body)
	if cerr := resp.Body.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return false, err
	}
	if resp.StatusCode != http.StatusOK {
		return false, fmt.Errorf("%s: %s: %s", path, resp.Status, body)
	}
	return string(body) == "1", nil
}

func median(sorted []float64) float64 {
	n := len(sorted)
	if n%2 == 1 {
		return sorted[n/2]
	}
	return (sorted[n/2-1] + sorted[n/2]) / 2
}

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	require.NoError(b, err, name)
	require.Positive(b, n, name)
	return n
}

// BenchmarkMiddleware prices what Handler adds to one request, without a
// network or a database read in the way: a handler that writes two bytes,
// served in process, bare and through Handler, with the same request (and
// cookie) every time. route is the router's share of it
// (consume.Router.Route with the token the middleware routes such a
// request with), open the session value's verification alone.
//
//	go test -run '^$' -bench BenchmarkMiddleware -benchmem ./web/caughtuphttp/
func BenchmarkMiddleware(b *testing.B) {
	e := setup(b, mods{})
	_, resp := e.post(b, e.client(b))
	value := e.cookie(resp).Value
	e.caughtUp(b, e.token(b, value))
	ok := []byte("ok")
	trivial := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(ok) })
	routed := e.mw.Handler(trivial)

	for _, tc := range []struct{ name, cookie string }{{"anonymous", ""}, {"session", value}} {
		req := httptest.NewRequest(http.MethodGet, "/items/1", nil)
		if tc.cookie != "" {
			req.AddCookie(&http.Cookie{Name: e.cfg.Cookie, Value: tc.cookie})
		}
		serve := func(b *testing.B, h http.Handler) {
			w := &sinkWriter{h: make(http.Header)}
			b.ReportAllocs()
			for b.Loop() {
				clear(w.h)
				w.code = 0
				h.ServeHTTP(w, req)
			}
			require.Equal(b, http.StatusOK, w.code)
		}
		b.Run(tc.name+"/bare", func(b *testing.B) { serve(b, trivial) })
		b.Run(tc.name+"/routed", func(b *testing.B) { serve(b, routed) })
		b.Run(tc.name+"/route", func(b *testing.B) {
			now := time.Now()
			in := e.mw.read(req, now)
			require.Nil(b, in.rejected)
			job := consume.Job{Token: e.mw.jobToken(in, e.router.Snapshot(), now), Source: "http GET", NoDefer: true, Hold: true}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if _, d, err := e.router.Route(ctx, job); err != nil || d.Outcome != consume.OutcomeReplica {
					b.Fatal(d.Outcome, err)
				}
			}
		})
		if tc.cookie != "" {
			b.Run(tc.name+"/open", func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if _, err := e.mw.codec.open(tc.cookie, time.Now()); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// sinkWriter is a ResponseWriter that keeps the status and drops the body.
type sinkWriter struct {
	h    http.Header
	code int
}

func (w *sinkWriter) Header() http.Header { return w.h }

func (w *sinkWriter) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
}

func (w *sinkWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return len(p), nil
}
