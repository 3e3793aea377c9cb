// Package kafkasuite is what the two Kafka adapters' tests share
// (caughtupkafka on kafka-go, caughtupkgo on franz-go): one test's
// database and router on the shared cluster (Env), a ledger of what
// handlers read (Ledger), the broker's topics and groups, and the tests
// that check the same behaviour of both through a Client that drives
// either adapter (TraceDeferral, Conformance).
//
// Tests run against the real Apache Kafka 4 broker of testkit/kafkatest
// (or the cluster KAFKA_BROKERS names) and the replicated PostgreSQL
// cluster of testkit/pgtest; the adapter's TestMain starts both.
package kafkasuite

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Env is one test's database on the shared cluster (table items, on every
// replica), its pools and a router over them that records into Metrics.
type Env struct {
	Cluster  *pgtest.Cluster
	DB       string
	Primary  *pgxpool.Pool
	Replicas []*pgxpool.Pool
	Router   *consume.Router
	Metrics  *sdkmetric.ManualReader
	MP       *sdkmetric.MeterProvider
}

// FastRouter shortens the router's waits so that deferrals show up within
// a test's time: a 200ms wait budget, then deferrals from 50ms to 250ms.
func FastRouter(c *consume.Config) {
	c.WaitBudget = 200 * time.Millisecond
	c.DeferInitial = 50 * time.Millisecond
	c.DeferMax = 250 * time.Millisecond
}

// SetupDB creates the test's database with its table items, its pools and
// its router (tweak adjusts the router's config), all closed at cleanup.
func SetupDB(t testing.TB, tweak func(*consume.Config)) *Env {
	t.Helper()
	ctx := t.Context()
	c := pgtest.Shared(t)
	e := &Env{Cluster: c, DB: pgtest.NewDatabase(t, c), Metrics: sdkmetric.NewManualReader()}
	e.Primary = e.Pool(t, c.Primary())
	_, err := e.Primary.Exec(ctx, `CREATE TABLE items (id bigint PRIMARY KEY, key text NOT NULL, seq int NOT NULL)`)
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	for _, n := range c.Replicas() {
		e.Replicas = append(e.Replicas, e.Pool(t, n))
	}
	e.MP = sdkmetric.NewMeterProvider(sdkmetric.WithReader(e.Metrics))
	t.Cleanup(func() { _ = e.MP.Shutdown(context.Background()) })
	rc := consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: e.Primary, Replicas: replay.Replicas(e.Replicas...)}},
		MeterProvider: e.MP,
	}
	if tweak != nil {
		tweak(&rc)
	}
	e.Router, err = consume.NewRouter(ctx, rc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.Router.Close() })
	return e
}

// Pool opens a pool on n with room for the tests' producer goroutines;
// closed before the database is dropped.
func (e *Env) Pool(t testing.TB, n *pgtest.Node) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(n.DSN(e.DB))
	require.NoError(t, err)
	cfg.MaxConns = 24
	p, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

// Insert writes the row of record (key, seq) and returns ctx carrying its
// token.
func (e *Env) Insert(ctx context.Context, id int64, key string, seq int) (context.Context, error) {
	return enqueue.InTx(ctx, e.Primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO items (id, key, seq) VALUES ($1, $2, $3)`, id, key, seq)
		return err
	})
}

// FarAhead is a token naming a position no replica will reach for a long
// time, on the cluster's real epoch: records carrying it wait (then read
// the primary after MaxAge).
func (e *Env) FarAhead(t testing.TB) position.Token {
	t.Helper()
	ctx := t.Context()
	sys, err := e.Cluster.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)
	tli, err := e.Cluster.Primary().Timeline(ctx)
	require.NoError(t, err)
	cur, err := e.Cluster.Primary().ReplayLSN(ctx)
	require.NoError(t, err)
	lsn := position.MustParseLSN(cur) + 1<<40
	return position.New("main", position.Epoch{SystemID: sys, Timeline: tli}, lsn, position.SourcePrimary, time.Now())
}

// Outcomes sums the router's decisions counter by outcome.
func (e *Env) Outcomes(t testing.TB) map[string]int64 {
	return e.Sums(t, "caughtup.consume.decisions", "caughtup.outcome")
}

// Results sums caughtup.kafka.messages by result.
func (e *Env) Results(t testing.TB) map[string]int64 {
	return e.Sums(t, "caughtup.kafka.messages", "caughtup.kafka.result")
}

// Sums sums the counter name by its attribute attr.
func (e *Env) Sums(t testing.TB, name, attr string) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, e.Metrics.Collect(context.Background(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				continue
			}
			for _, dp := range sum.DataPoints {
				v, _ := dp.Attributes.Value(attribute.Key(attr))
				out[v.AsString()] += dp.Value
			}
		}
	}
	return out
}

// PauseAll pauses replay on every replica until ResumeAll or cleanup.
func (e *Env) PauseAll(t *testing.T) {
	t.Helper()
	for _, n := range e.Cluster.Replicas() {
		require.NoError(t, n.PauseReplay(t.Context()))
	}
	t.Cleanup(func() { e.ResumeAll(t) })
}

// ResumeAll resumes replay on every replica.
func (e *Env) ResumeAll(t *testing.T) {
	for _, n := range e.Cluster.Replicas() {
		if err := n.ResumeReplay(context.Background()); err != nil {
			t.Errorf("resume %s: %v", n.Name(), err)
		}
	}
}

// PauseRandomly pauses replay on one or both replicas for random spells of
// up to maxPause until ctx ends, and leaves every replica resumed.
func PauseRandomly(ctx context.Context, t *testing.T, replicas []*pgtest.Node, maxPause time.Duration) {
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	bg := context.Background()
	for ctx.Err() == nil {
		paused := replicas
		if rng.IntN(3) != 0 {
			paused = []*pgtest.Node{replicas[rng.IntN(len(replicas))]}
		}
		for _, n := range paused {
			if err := n.PauseReplay(bg); err != nil {
				t.Errorf("pause %s: %v", n.Name(), err)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(int64(maxPause) + 1))):
		}
		for _, n := range paused {
			if err := n.ResumeReplay(bg); err != nil {
				t.Errorf("resume %s: %v", n.Name(), err)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(int64(300 * time.Millisecond)))):
		}
	}
}

// Payload is a test record's value: "id,key,seq".
func Payload(id int64, key string, seq int) []byte {
	return []byte(fmt.Sprintf("%d,%s,%d", id, key, seq))
}

// ParsePayload reads a Payload.
func ParsePayload(v []byte) (id int64, key string, seq int, err error) {
	parts := strings.Split(string(v), ",")
	if len(parts) != 3 {
		return 0, "", 0, fmt.Errorf("payload %q", v)
	}
	if id, err = strconv.ParseInt(parts[0], 10, 64); err != nil {
		return 0, "", 0, err
	}
	seq, err = strconv.Atoi(parts[2])
	return id, parts[1], seq, err
}

// Logger sends warnings and errors to the test log.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(logWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type logWriter struct{ t testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}
