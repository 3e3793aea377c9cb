package caughtuphttp

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/metrictest"
)

// TestReadYourWrites: a browser writes, then reads while every replica's
// replay is paused: it reads the primary, never a replica without its
// row. Once the replicas have caught up, the same read goes to a replica.
// These tests pause replay on the shared cluster, so none runs in
// parallel.
func TestReadYourWrites(t *testing.T) {
	e := setup(t, mods{})
	browser := e.client(t)

	// Before any write: no cookie, and a replica serves the request.
	id0, resp := e.post(t, browser)
	first := e.cookie(resp)
	require.NotNil(t, first, "a request that wrote sets the cookie")
	require.True(t, first.Secure && first.HttpOnly && first.SameSite == http.SameSiteLaxMode, "%+v", first)
	require.Equal(t, int(DefaultMaxAge/time.Second), first.MaxAge)
	require.Equal(t, "/", first.Path)
	tok0 := e.token(t, first.Value)
	e.caughtUp(t, tok0)
	anon := e.client(t)
	rd, resp := e.get(t, anon, id0, "")
	require.True(t, rd.Found)
	require.NotEmpty(t, rd.Replica, "a request without a session token reads a replica: %+v", rd)
	require.Nil(t, e.cookie(resp), "a request that wrote nothing sets no cookie")

	pauseAll(t, e.c)
	id, resp := e.post(t, browser)
	c := e.cookie(resp)
	require.NotNil(t, c)
	tok := e.token(t, c.Value)
	e0, _ := tok0.Entry("main")
	e1, _ := tok.Entry("main")
	require.Greater(t, e1.LSN, e0.LSN, "the new write's position is merged in")

	for range 3 {
		rd, resp := e.get(t, browser, id, "")
		require.True(t, rd.Found, "stale read: %+v", rd)
		require.Empty(t, rd.Replica, "paused replicas lack the row; the request must read the primary: %+v", rd)
		require.Equal(t, consume.ReasonCannotDefer.String(), rd.Reason)
		require.Nil(t, e.cookie(resp))
	}
	// Jobs the request enqueues carry the session's writes.
	resp, body := e.do(t, browser, e.request(t, http.MethodGet, "/token", ""))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	jobTok, err := position.Decode(body)
	require.NoError(t, err)
	je, ok := jobTok.Entry("main")
	require.True(t, ok, body)
	require.GreaterOrEqual(t, je.LSN, e1.LSN, "a job enqueued by a later request must see the session's write")

	resumeAll(t, e.c)
	e.caughtUp(t, tok)
	rd, _ = e.get(t, browser, id, "")
	require.True(t, rd.Found)
	require.NotEmpty(t, rd.Replica, "caught up: the session reads a replica again: %+v", rd)
}

// TestBadCookies: a value of any rejected kind (altered, expired, issued
// in the future, signed by a key this process lacks, undecodable, naming
// another cluster) is ignored: within the fallback cap the request reads
// the primary, the value is counted by reason and result, and the
// response clears the cookie and is kept from shared caches.
func TestBadCookies(t *testing.T) {
	e := setup(t, mods{})
	id, resp := e.post(t, e.client(t))
	valid := e.cookie(resp).Value
	tok := e.token(t, valid)
	e.caughtUp(t, tok)
	cases := badValues(t, e, valid, tok)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			attrs := []attribute.KeyValue{attribute.String("caughtup.reason", tc.reason.String()), attribute.String("caughtup.result", "primary")}
			before := metrictest.Sum(t, e.reader, "caughtup.http.tokens.rejected", attrs...)
			rd, resp := e.get(t, e.client(t), id, tc.value)
			require.True(t, rd.Found)
			require.Empty(t, rd.Replica, "an ignored cookie reads the primary within the cap: %+v", rd)
			require.Equal(t, before+1, metrictest.Sum(t, e.reader, "caughtup.http.tokens.rejected", attrs...))
			c := e.cookie(resp)
			require.NotNil(t, c, "the ignored cookie is cleared")
			require.Empty(t, c.Value)
			require.Less(t, c.MaxAge, 0)
			require.Equal(t, "private", resp.Header.Get("Cache-Control"))
		})
	}
	require.Equal(t, int64(len(cases)), metrictest.Sum(t, e.reader, "caughtup.http.tokens.rejected"))
	require.Equal(t, int64(len(cases)), metrictest.Sum(t, e.reader, "caughtup.consume.fallback.budget",
		attribute.String("caughtup.budget", "local"), attribute.String("caughtup.result", "allowed")), "each charged to the cap")
	// The valid value still reads a replica (it is caught up) and is
	// neither counted nor cleared.
	rd, resp := e.get(t, e.client(t), id, valid)
	require.NotEmpty(t, rd.Replica, "%+v", rd)
	require.Nil(t, e.cookie(resp))
	require.Empty(t, resp.Header.Get("Cache-Control"))
	require.Equal(t, int64(len(cases)), metrictest.Sum(t, e.reader, "caughtup.http.tokens.rejected"))
}

// TestLateWrite: a write after the header went out cannot reach the
// client, and is counted.
func TestLateWrite(t *testing.T) {
	e := setup(t, mods{})
	resp, _ := e.do(t, e.client(t), e.request(t, http.MethodPost, "/late", ""))
	require.Equal(t, http.StatusAccepted, resp.StatusCode)
	require.Nil(t, e.cookie(resp))
	require.Equal(t, int64(1), metrictest.Sum(t, e.reader, "caughtup.http.tokens.late"))

	// Flushing through a ResponseController sends the cookie first.
	resp, _ = e.do(t, e.client(t), e.request(t, http.MethodPost, "/flush", ""))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.NotNil(t, e.cookie(resp))
	require.Equal(t, int64(1), metrictest.Sum(t, e.reader, "caughtup.http.tokens.late"))
	require.Equal(t, int64(1), metrictest.Sum(t, e.reader, "caughtup.http.tokens.issued"))
}

// TestResponsePaths: the cookie goes out with the final response however
// the handler ends it, and a hijacked connection's writes count as late.
func TestResponsePaths(t *testing.T) {
	e := setup(t, mods{})
	for _, path := range []string{"/hints", "/silent"} {
		resp, body := e.do(t, e.client(t), e.request(t, http.MethodPost, path, ""))
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		c := e.cookie(resp)
		require.NotNil(t, c, path)
		_, ok := e.token(t, c.Value).Entry("main")
		require.True(t, ok, path)
	}
	require.Equal(t, int64(2), metrictest.Sum(t, e.reader, "caughtup.http.tokens.issued"))
	require.Zero(t, metrictest.Sum(t, e.reader, "caughtup.http.tokens.late"))

	resp, body := e.do(t, e.client(t), e.request(t, http.MethodPost, "/hijack", ""))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "ok", body)
	require.Nil(t, e.cookie(resp))
	require.Equal(t, int64(1), metrictest.Sum(t, e.reader, "caughtup.http.tokens.late"))
	require.Equal(t, int64(2), metrictest.Sum(t, e.reader, "caughtup.http.tokens.issued"))
}

// TestHeader: an API client without cookies carries the value in a
// header.
func TestHeader(t *testing.T) {
	e := setup(t, mods{http: func(c *Config) { c.Header = "Caughtup-Session" }})
	api := &http.Client{Transport: e.srv.Client().Transport} // no jar
	pauseAll(t, e.c)
	id, resp := e.post(t, api)
	value := resp.Header.Get("Caughtup-Session")
	require.NotEmpty(t, value)
	req := e.request(t, http.MethodGet, "/items/"+strings.TrimSpace(strconvI(id)), "")
	req.Header.Set("Caughtup-Session", value)
	resp, body := e.do(t, api, req)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, body, `"found":true`)
	require.Contains(t, body, `"replica":""`)
}

// TestUnavailable: with the fallback cap spent, a request no replica can
// serve is held for MaxWait and then answered 503, not read stale.
func TestUnavailable(t *testing.T) {
	e := setup(t, mods{
		router: func(c *consume.Config) { c.PrimaryRate, c.PrimaryBurst = rate.Limit(1e-6), 1 },
		http:   func(c *Config) { c.MaxWait = 300 * time.Millisecond },
	})
	browser := e.client(t)
	pauseAll(t, e.c)
	id, _ := e.post(t, browser)
	rd, _ := e.get(t, browser, id, "") // the cap's one token
	require.True(t, rd.Found)
	require.Empty(t, rd.Replica)
	resp, _ := e.do(t, browser, e.request(t, http.MethodGet, "/items/"+strconvI(id), ""))
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.NotEmpty(t, resp.Header.Get("Retry-After"))
	require.Equal(t, int64(1), metrictest.Sum(t, e.reader, "caughtup.http.requests.unavailable"))
}
