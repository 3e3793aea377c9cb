package consume

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// slowConn delays every write by delay: a publisher whose messages take
// that long on their way to Redis.
type slowConn struct {
	net.Conn
	delay time.Duration
}

func (c slowConn) Write(b []byte) (int, error) {
	time.Sleep(c.delay)
	return c.Conn.Write(b)
}

// TestFeedRestartRace: a router on the feed of two publishers, one of
// them ~300ms late on its way to Redis, while a replica is crash-restarted
// under write load and comes back below what it had replayed. Tokens of
// writes just before each crash are routed and read: never stale, though
// the slow publisher's messages of the old run arrive after the restart.
func TestFeedRestartRace(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	f := newFleetEnv(t, c, "")
	slow := redis.NewClient(&redis.Options{Addr: f.rdb.Options().Addr, MaxRetries: -1,
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return slowConn{Conn: conn, delay: 300 * time.Millisecond}, nil
		}})
	t.Cleanup(func() { _ = slow.Close() })
	f.publisher(t, "pub-fast")
	f.publisher(t, "pub-slow", func(sc *feed.SenderConfig, _ *replay.PublisherConfig) {
		sc.Client = slow
		sc.Timeout = 2 * time.Second
	})
	r := f.feedRouter(t, func(cfg *Config) { cfg.WaitBudget = -1 })
	ctx := ctxT(t)
	node := c.Replicas()[0]
	require.NoError(t, node.Exec(ctx, "", "CHECKPOINT"))

	// Write load all along.
	load, stopLoad := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for load.Err() == nil {
			_, _ = f.primary.Exec(load, "INSERT INTO items (v) VALUES ('load')")
		}
	})
	t.Cleanup(func() { stopLoad(); wg.Wait() })

	const trials = 20
	stale, onR1 := 0, 0
	for trial := range trials {
		id, tok := f.write(t)
		seen(t, r, tok)
		require.NoError(t, node.Kill())
		require.NoError(t, node.SetConf(ctx, map[string]string{"recovery_min_apply_delay": "'1h'"}))
		require.NoError(t, node.StartAccepting(ctx))
		for range 10 { // reads over the ~300ms the slow publisher's old messages keep coming
			h, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
			if err != nil {
				require.ErrorIs(t, err, ErrDeferred)
				continue
			}
			ok, err := readRow(h, DB(h, "main"), id)
			if err != nil {
				require.ErrorIs(t, err, ErrReplicaBehind)
				continue
			}
			if !ok {
				stale++
			}
			if d.Databases[0].Replica == "r1" {
				onR1++
			}
			time.Sleep(30 * time.Millisecond)
		}
		require.NoError(t, node.SetConf(ctx, map[string]string{"recovery_min_apply_delay": ""}))
		at := func() position.LSN {
			l, err := node.ReplayLSN(ctx)
			require.NoError(t, err)
			return position.MustParseLSN(l)
		}
		require.Eventually(t, func() bool { return at() >= tok.Entries[0].LSN }, feedDeadline, 10*time.Millisecond, "trial %d: r1 did not catch up again", trial)
	}
	t.Logf("%d trials, %d reads routed to r1 after its crash; feed %+v", trials, onR1, r.Tracker().Feed())
	require.Zero(t, stale, "stale reads after a replica's crash restart")
}
