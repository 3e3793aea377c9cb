package examplesvc

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestCluster starts the cluster without Kafka and checks what Env says:
// the primary and two replicas of the database "example", in recovery,
// and a Redis that answers; nothing about Kafka. Then replay pauses at
// random, and stop leaves every replica replaying.
func TestCluster(t *testing.T) {
	ctx := t.Context()
	c, err := Start(ctx, Options{Logf: t.Logf})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()

	env := c.Env(Database)
	keys := make([]string, 0, len(env))
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		keys = append(keys, k)
	}
	require.Equal(t, []string{EnvPrimary, EnvReplicas, EnvRedis}, keys)
	getenv := c.Getenv(Database)
	require.Empty(t, getenv(EnvKafka))
	inRecovery := func(url string) bool {
		conn, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		defer func() { _ = conn.Close(ctx) }()
		var r bool
		var db string
		require.NoError(t, conn.QueryRow(ctx, "SELECT pg_is_in_recovery(), current_database()").Scan(&r, &db))
		require.Equal(t, Database, db)
		return r
	}
	require.False(t, inRecovery(getenv(EnvPrimary)))
	replicas := strings.Split(getenv(EnvReplicas), ",")
	require.Len(t, replicas, 2)
	for _, u := range replicas {
		require.True(t, inRecovery(u))
	}
	conn, err := net.Dial("tcp", getenv(EnvRedis))
	require.NoError(t, err)
	require.NoError(t, conn.Close())

	// Pauses: at least one replica is seen paused within a few seconds.
	stop := c.PauseReplay(ctx, 500*time.Millisecond, t.Logf)
	sawPause := false
	for deadline := time.Now().Add(10 * time.Second); !sawPause && time.Now().Before(deadline); {
		for _, n := range c.PG.Replicas() {
			var state string
			require.NoError(t, pgxQueryRow(ctx, n.DSN(""), "SELECT pg_get_wal_replay_pause_state()", &state))
			sawPause = sawPause || state != "not paused"
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	stop() // a second stop does nothing
	require.True(t, sawPause, "no replica paused")
	for _, n := range c.PG.Replicas() {
		var state string
		require.NoError(t, pgxQueryRow(ctx, n.DSN(""), "SELECT pg_get_wal_replay_pause_state()", &state))
		require.Equal(t, "not paused", state, n.Name())
	}
}

func pgxQueryRow(ctx context.Context, url, sql string, dest ...any) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(ctx) }()
	return conn.QueryRow(ctx, sql).Scan(dest...)
}

// TestPauseReplayNever: maxPause 0 starts nothing, and stop returns at
// once, however often it is called.
func TestPauseReplayNever(t *testing.T) {
	stop := (&Cluster{}).PauseReplay(context.Background(), 0, nil)
	stop()
	stop()
}
