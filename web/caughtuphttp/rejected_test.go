package caughtuphttp

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
)

// badValue is a session value the middleware must reject, and why.
type badValue struct {
	name   string
	value  string
	reason Reason
}

// badValues are values of every kind the middleware rejects, built from
// valid, a value e issued, and tok, its token.
func badValues(t testing.TB, e *env, valid string, tok position.Token) []badValue {
	t.Helper()
	now := time.Now()
	other, err := feed.GenerateKey(e.mw.codec.signer.ID) // the same ID, another secret
	require.NoError(t, err)
	foreign, err := feed.GenerateKey("elsewhere")
	require.NoError(t, err)
	seal := func(c *codec, tok position.Token, issued time.Time, maxAge time.Duration) string {
		v, err := c.seal(tok, issued, maxAge)
		require.NoError(t, err)
		return v
	}
	entry, ok := tok.Entry("main")
	require.True(t, ok)
	otherCluster := position.New("main", position.Epoch{SystemID: entry.Epoch.SystemID + 1, Timeline: 1}, 1, position.SourcePrimary, now)
	merged := position.Of(now, position.Entry{Database: "main", LSN: entry.LSN}) // an epoch merged unknown
	tampered := []byte(valid)
	tampered[len(valid)/3] ^= 1
	// Signed with e's key, but the token inside does not decode.
	id := e.mw.codec.signer.ID
	p := append([]byte{valueVersion, byte(len(id))}, id...)
	p = binary.BigEndian.AppendUint64(p, uint64(now.UnixMilli()))
	p = binary.BigEndian.AppendUint32(p, uint32(DefaultMaxAge/time.Second))
	p = append(p, "v9;nonsense"...)
	badToken := b64.EncodeToString(p) + "." + b64.EncodeToString(mac(e.mw.codec.signer.Secret, p))

	return []badValue{
		{"tampered", string(tampered), ReasonBadSignature},
		{"expired", seal(e.mw.codec, tok, now.Add(-DefaultMaxAge-time.Minute), DefaultMaxAge), ReasonExpired},
		{"future", seal(e.mw.codec, tok, now.Add(time.Hour), DefaultMaxAge), ReasonFuture},
		{"other secret", seal(newCodec([]feed.Key{other}, time.Second), tok, now, DefaultMaxAge), ReasonBadSignature},
		{"other key", seal(newCodec([]feed.Key{foreign}, time.Second), tok, now, DefaultMaxAge), ReasonUnknownKey},
		{"malformed", "not-a-value", ReasonMalformed},
		{"bad token", badToken, ReasonBadToken},
		{"other cluster", seal(e.mw.codec, otherCluster, now, DefaultMaxAge), ReasonOtherCluster},
		{"merged epoch", seal(e.mw.codec, merged, now, DefaultMaxAge), ReasonOtherCluster},
	}
}

// lockedBuffer is a log destination shared by the server's goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// outcome is one request's answer, checked on the test's goroutine.
type outcome struct {
	value        badValue // zero for a valid session's read
	status       int
	rd           read
	body         string
	cleared      bool // the response cleared the session cookie
	cacheControl string
	err          error
}

// getItem reads item id through c, sending value as the cookie when set
// (a client without a jar: every request carries it).
func (e *env) getItem(c *http.Client, id int64, value string) outcome {
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+"/items/"+strconv.FormatInt(id, 10), nil)
	if err != nil {
		return outcome{err: err}
	}
	if value != "" {
		req.AddCookie(&http.Cookie{Name: e.cfg.Cookie, Value: value})
	}
	resp, err := c.Do(req)
	if err != nil {
		return outcome{err: err}
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	o := outcome{status: resp.StatusCode, body: string(body), err: err, cacheControl: resp.Header.Get("Cache-Control")}
	if ck := e.cookie(resp); ck != nil && ck.Value == "" && ck.MaxAge < 0 {
		o.cleared = true
	}
	if o.err == nil && o.status == http.StatusOK {
		o.err = json.Unmarshal(body, &o.rd)
	}
	return o
}

// TestRejectedFallbackCap is issue 36's acceptance for rejected
// session values: with the router's fallback cap at 5/s and a burst of
// 10, 2,000 requests carrying values of every rejected kind read the
// primary no more often than the cap allows over the run; each is
// answered by the handler, and those past the cap read a replica as a
// request without a session does, with the cookie cleared; each is
// counted by reason and result and logged, sampled. Browsers with valid
// sessions write and read in the same run while one replica's replay is
// paused: none reads stale.
func TestRejectedFallbackCap(t *testing.T) {
	const (
		capRate, capBurst = 5, 10
		badRequests       = 2000
		badClients        = 8
		browsers          = 2
	)
	var logs lockedBuffer
	e := setup(t, mods{
		router: func(c *consume.Config) { c.PrimaryRate, c.PrimaryBurst = capRate, capBurst },
		http: func(c *Config) {
			c.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(&logs, t.Output()), &slog.HandlerOptions{Level: slog.LevelWarn}))
		},
	})
	ctx := ctxT(t)
	id, resp := e.post(t, e.client(t))
	valid := e.cookie(resp).Value
	tok := e.token(t, valid)
	e.caughtUp(t, tok) // every replica has the row the bad values read
	values := badValues(t, e, valid, tok)
	require.Len(t, e.c.Replicas(), 2, "one replica paused, one serving")
	paused := e.c.Replicas()[0]
	require.NoError(t, paused.PauseReplay(ctx))
	t.Cleanup(func() { resumeAll(t, e.c) })

	tr := e.srv.Client().Transport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = badClients + browsers
	t.Cleanup(tr.CloseIdleConnections)
	anon := &http.Client{Transport: tr}

	start := time.Now()
	var (
		wg      sync.WaitGroup
		next    atomic.Int64
		done    atomic.Bool
		bad     = make([]outcome, badRequests)
		mu      sync.Mutex
		browsed []outcome
	)
	for range badClients {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < badRequests; i = int(next.Add(1) - 1) {
				v := values[i%len(values)]
				bad[i] = e.getItem(anon, id, v.value)
				bad[i].value = v
			}
		})
	}
	var writers sync.WaitGroup
	for range browsers {
		writers.Go(func() {
			jar, _ := cookiejar.New(nil)
			browser := &http.Client{Transport: tr, Jar: jar}
			for n := 0; n < 10 || !done.Load(); n++ {
				req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/items", nil)
				resp, err := browser.Do(req)
				if err != nil {
					mu.Lock()
					browsed = append(browsed, outcome{err: err})
					mu.Unlock()
					return
				}
				body, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					mu.Lock()
					browsed = append(browsed, outcome{status: resp.StatusCode, body: string(body), err: fmt.Errorf("POST /items: %s", body)})
					mu.Unlock()
					return
				}
				wrote, _ := strconv.ParseInt(string(body), 10, 64)
				o := e.getItem(browser, wrote, "") // the jar sends the session's cookie
				mu.Lock()
				browsed = append(browsed, o)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	done.Store(true)
	writers.Wait()
	elapsed := time.Since(start)
	e.inflight.Wait()

	allowance := capBurst + capRate*elapsed.Seconds()
	primaryReads, sessionLess := 0, 0
	byReason := map[Reason]int{}
	for i, o := range bad {
		require.NoError(t, o.err, "bad request %d (%s)", i, o.value.name)
		require.Equal(t, http.StatusOK, o.status, "bad request %d (%s) not answered by the handler: %s", i, o.value.name, o.body)
		require.True(t, o.rd.Found, "bad request %d (%s): %+v", i, o.value.name, o.rd)
		require.True(t, o.cleared, "bad request %d (%s): the ignored cookie is cleared", i, o.value.name)
		require.Contains(t, o.cacheControl, "private", "a response that clears the cookie is kept from shared caches")
		byReason[o.value.reason]++
		if o.rd.Replica == "" {
			primaryReads++
			continue
		}
		sessionLess++
		require.Equal(t, consume.OutcomeReplica.String(), o.rd.Outcome, "past the cap: read as a request without a session: %+v", o.rd)
	}
	validReads, validPrimary, unavailable := 0, 0, 0
	for i, o := range browsed {
		require.NoError(t, o.err, "browser read %d", i)
		if o.status == http.StatusServiceUnavailable {
			unavailable++ // held for the cap and answered 503: not stale
			continue
		}
		require.Equal(t, http.StatusOK, o.status, o.body)
		require.True(t, o.rd.Found, "stale read of a session's own write: %+v", o.rd)
		validReads++
		if o.rd.Replica == "" {
			validPrimary++
		}
	}
	t.Logf("%d bad requests in %v: %d read the primary, %d session-less; browsers: %d reads (%d primary, %d unavailable); allowance %.1f",
		badRequests, elapsed.Round(time.Millisecond), primaryReads, sessionLess, validReads, validPrimary, unavailable, allowance)
	require.Positive(t, validReads, "the browsers read their writes during the run")
	require.LessOrEqual(t, float64(primaryReads+validPrimary), allowance,
		"primary reads over %v: more than the cap's burst %d + %d/s", elapsed, capBurst, capRate)
	require.Equal(t, badRequests, primaryReads+sessionLess)

	for _, v := range values {
		require.Positive(t, byReason[v.reason], v.name)
	}
	count := func(reason Reason, res result) int64 {
		return metrictest.Sum(t, e.reader, "caughtup.http.tokens.rejected",
			attribute.String(attrReason, reason.String()), attribute.String(attrResult, res.String()))
	}
	var counted [numResults]int64
	for r := Reason(1); int(r) < numReasons; r++ {
		p, s := count(r, resultPrimary), count(r, resultSessionLess)
		require.EqualValues(t, byReason[r], p+s, "%s counted once a request", r)
		counted[resultPrimary] += p
		counted[resultSessionLess] += s
	}
	require.EqualValues(t, primaryReads, counted[resultPrimary])
	require.EqualValues(t, sessionLess, counted[resultSessionLess])
	allowed := metrictest.Sum(t, e.reader, "caughtup.consume.fallback.budget",
		attribute.String("caughtup.budget", "local"), attribute.String("caughtup.result", "allowed"))
	require.GreaterOrEqual(t, allowed, int64(primaryReads+validPrimary), "every primary read was charged to the cap")

	// Logged, sampled: the first few of each kind and result, then one
	// every warnInterval.
	lines := strings.Count(logs.String(), "the fallback cap is spent; the request reads as one without a session")
	require.Positive(t, lines)
	kinds := 0
	for _, n := range byReason {
		if n > 0 {
			kinds++
		}
	}
	require.LessOrEqual(t, lines, kinds*(warnFirst+int(elapsed/warnInterval)+1), "the log is sampled")
}

// TestRejectedFallbackCapUnavailable: past the cap, a rejected value reads as
// a request without a session; when no replica is healthy either, that
// request is held and answered unavailable like any other, and the
// response still clears the cookie.
func TestRejectedFallbackCapUnavailable(t *testing.T) {
	e := setup(t, mods{
		router: func(c *consume.Config) {
			c.PrimaryRate, c.PrimaryBurst = rate.Limit(1e-6), 1
			c.Tracker.MaxLagBytes = 1 // a replica behind at all is unhealthy
		},
		http: func(c *Config) { c.MaxWait = 300 * time.Millisecond },
	})
	id, _ := e.post(t, e.client(t))
	pauseAll(t, e.c)
	e.post(t, e.client(t)) // the replicas fall behind
	ctx := ctxT(t)
	for {
		s := e.router.Snapshot()
		healthy := false
		for _, rs := range s.Database("main").Replicas {
			healthy = healthy || rs.Healthy
		}
		if !healthy {
			break
		}
		select {
		case <-s.Changed():
		case <-ctx.Done():
			t.Fatal("the replicas never became unhealthy")
		}
	}
	anon := &http.Client{Transport: e.srv.Client().Transport}
	first := e.getItem(anon, id, "not-a-value")
	require.NoError(t, first.err)
	require.Equal(t, http.StatusOK, first.status, "the cap's one token: %s", first.body)
	require.Empty(t, first.rd.Replica)
	require.True(t, first.cleared)

	second := e.getItem(anon, id, "not-a-value")
	require.NoError(t, second.err)
	require.Equal(t, http.StatusServiceUnavailable, second.status, second.body)
	require.True(t, second.cleared, "the unavailable answer clears the ignored cookie too")
	require.Contains(t, second.cacheControl, "private")
	require.EqualValues(t, 1, metrictest.Sum(t, e.reader, "caughtup.http.tokens.rejected", attribute.String(attrResult, "session_less")))
	require.EqualValues(t, 1, metrictest.Sum(t, e.reader, "caughtup.http.requests.unavailable"))
}

// TestForeignEntries: before routing, an entry names another cluster when
// the tracker's primary has another system identifier, or when its own
// epoch is unknown; with the primary unknown it is left to the router.
func TestForeignEntries(t *testing.T) {
	t.Parallel()
	const sys = 0x6f1e2d3c4b5a6978
	ep := func(sys uint64, tli uint32) position.Epoch { return position.Epoch{SystemID: sys, Timeline: tli} }
	db := func(name string, primary position.Epoch, replicas int) replay.DatabaseState {
		ds := replay.DatabaseState{Name: name, Primary: replay.PrimaryState{Epoch: primary}}
		for i := range replicas {
			ds.Replicas = append(ds.Replicas, replay.ReplicaState{Name: fmt.Sprint("r", i+1)})
		}
		return ds
	}
	snap := &replay.Snapshot{Databases: []replay.DatabaseState{
		db("main", ep(sys, 2), 2),
		db("unknown", position.Epoch{}, 1),
		db("bare", ep(sys, 1), 0),
	}}
	now := time.Now()
	entry := func(name string, e position.Epoch) position.Entry {
		return position.Entry{Database: name, Epoch: e, LSN: 100, Source: position.SourcePrimary}
	}
	for _, tc := range []struct {
		name string
		tok  position.Token
		want []string
	}{
		{"same cluster, older timeline", position.Of(now, entry("main", ep(sys, 1))), nil},
		{"same cluster, newer timeline", position.Of(now, entry("main", ep(sys, 3))), nil},
		{"other system", position.Of(now, entry("main", ep(sys+1, 2))), []string{"main"}},
		{"unknown epoch", position.Of(now, entry("main", position.Epoch{})), []string{"main"}},
		{"primary unknown: the router judges", position.Of(now, entry("unknown", ep(sys+1, 1))), nil},
		{"primary unknown, entry unknown", position.Of(now, entry("unknown", position.Epoch{})), []string{"unknown"}},
		{"no replicas: the primary anyway", position.Of(now, entry("bare", ep(sys+1, 1))), nil},
		{"not the router's", position.Of(now, entry("elsewhere", ep(sys+1, 1))), nil},
		{"two databases", position.Of(now, entry("main", ep(sys+1, 1)), entry("unknown", position.Epoch{})), []string{"main", "unknown"}},
	} {
		require.Equal(t, tc.want, foreignEntries(tc.tok, snap), tc.name)
	}
}

// TestForeignAfterRouting: an entry the router found incomparable with
// this cluster (judged by the replicas, its primary unknown) and that
// foreignEntries had not found is reported once and dropped from the
// next value; one already dropped is not reported again.
func TestForeignAfterRouting(t *testing.T) {
	t.Parallel()
	now := time.Now()
	tok := position.Of(now,
		position.Entry{Database: "a", Epoch: position.Epoch{SystemID: 1, Timeline: 1}, LSN: 1},
		position.Entry{Database: "b", Epoch: position.Epoch{SystemID: 1, Timeline: 1}, LSN: 1},
		position.Entry{Database: "c", Epoch: position.Epoch{SystemID: 1, Timeline: 1}, LSN: 1})
	d := consume.Decision{Databases: []consume.DatabaseDecision{
		{Database: "a", Outcome: consume.OutcomePrimaryEpoch, Incomparable: position.OtherSystem},
		{Database: "b", Outcome: consume.OutcomePrimaryEpoch, Incomparable: position.OtherSystem},
		{Database: "c", Outcome: consume.OutcomePrimaryEpoch, Incomparable: position.PastSwitchpoint},
		{Database: "d", Outcome: consume.OutcomePrimaryEpoch, Incomparable: position.UnknownEpoch}, // not carried
	}}
	s := &session{in: carried{tok: tok, foreign: []string{"a"}}, drop: []string{"a"}}
	require.Equal(t, []string{"b"}, s.foreign(d))
	require.Equal(t, []string{"a", "b"}, s.drop)
	require.Equal(t, []string{"c"}, func() (names []string) {
		for _, e := range without(tok, s.drop).Entries {
			names = append(names, e.Database)
		}
		return names
	}(), "a timeline past its switchpoint is kept")
}
