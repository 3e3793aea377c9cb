package caughtuphttp

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
)

// BenchmarkRequest measures what the middleware adds to a request that
// reads one row: the same handler (one point query) served through
// Handler, reading the pool the router chose, and bare, reading a replica
// pool of the application's own. Requests are served in process
// (httptest.NewRecorder), without a network between client and server, so
// that the middleware's share is not hidden in the transport; each
// iteration serves one of each, in alternating order, so that load from
// elsewhere on the machine hits both alike. It reports bare-µs/req,
// routed-µs/req and bare/routed (1 is as fast as the bare handler), for a
// request without a session value ("anonymous") and one whose value the
// replicas have replayed ("session").
//
//	go test -run '^$' -bench BenchmarkRequest -benchtime 5000x -count 3 ./web/caughtuphttp/
func BenchmarkRequest(b *testing.B) {
	e := setup(b, mods{})
	query := func(ctx context.Context, p *pgxpool.Pool) error {
		var n int
		return p.QueryRow(ctx, "SELECT count(*) FROM items WHERE id = 1").Scan(&n)
	}
	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := query(r.Context(), e.replicas[0]); err != nil {
			http.Error(w, err.Error(), 500)
		}
	})
	routed := e.mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := query(r.Context(), consume.DB(r.Context(), "main")); err != nil {
			http.Error(w, err.Error(), 500)
		}
	}))
	_, resp := e.post(b, e.client(b))
	value := e.cookie(resp).Value
	e.caughtUp(b, e.token(b, value))

	for _, tc := range []struct{ name, cookie string }{{"anonymous", ""}, {"session", value}} {
		b.Run(tc.name, func(b *testing.B) {
			serve := func(h http.Handler) time.Duration {
				req := httptest.NewRequest(http.MethodGet, "/items/1", nil)
				if tc.cookie != "" {
					req.AddCookie(&http.Cookie{Name: e.cfg.Cookie, Value: tc.cookie})
				}
				rec := httptest.NewRecorder()
				start := time.Now()
				h.ServeHTTP(rec, req)
				el := time.Since(start)
				require.Equal(b, http.StatusOK, rec.Code, rec.Body.String())
				return el
			}
			var tb, tr time.Duration
			for i := 0; b.Loop(); i++ {
				if i%2 == 0 {
					tb += serve(bare)
					tr += serve(routed)
				} else {
					tr += serve(routed)
					tb += serve(bare)
				}
			}
			n := float64(b.N)
			b.ReportMetric(tb.Seconds()*1e6/n, "bare-µs/req")
			b.ReportMetric(tr.Seconds()*1e6/n, "routed-µs/req")
			b.ReportMetric(tb.Seconds()/tr.Seconds(), "bare/routed")
		})
	}
}
