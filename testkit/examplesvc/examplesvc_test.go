package examplesvc

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestCounts(t *testing.T) {
	t.Parallel()
	require.Equal(t, "", Counts(map[string]int{}))
	require.Equal(t, "a=3 b=1 primary=12", Counts(map[string]int64{"primary": 12, "b": 1, "a": 3}))
}

// TestTallyOrder: a message that runs before an earlier one of its key is
// one violation; a rerun of an earlier one is none; keys are independent.
func TestTallyOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var ta Tally
	ta.Ran(ctx, "main", "a", 0, false)
	ta.Ran(ctx, "main", "a", 2, false) // 1 has not run
	ta.Ran(ctx, "main", "a", 1, true)
	ta.Ran(ctx, "main", "a", 0, false) // a redelivery
	ta.Ran(ctx, "main", "b", 0, false)
	require.Equal(t, 2, ta.Next("a"))
	require.Equal(t, 1, ta.Next("b"))
	require.Equal(t, 0, ta.Next("c"))
	require.Equal(t, 1, ta.Violations())
	require.Equal(t, 1, ta.Stale())
	// No decision in ctx: Where names the zero outcome, without a replica.
	require.Equal(t, Where(ctx, "main")+"=5", ta.Outcomes())
}

func TestTallyConcurrent(t *testing.T) {
	t.Parallel()
	var ta Tally
	var wg sync.WaitGroup
	for k := range 4 {
		wg.Go(func() {
			key := string(rune('a' + k))
			for seq := range 100 {
				ta.Ran(context.Background(), "main", key, seq, false)
			}
		})
	}
	wg.Wait()
	require.Equal(t, 0, ta.Violations())
	require.Equal(t, 100, ta.Next("d"))
}

func TestGo(t *testing.T) {
	t.Parallel()
	errStopped := errors.New("stopped")
	stop := Go(context.Background(), func(ctx context.Context) error {
		<-ctx.Done()
		return errStopped
	})
	require.ErrorIs(t, stop(), errStopped)
	require.ErrorIs(t, stop(), errStopped, "a second stop returns the same error")
}

func TestAwait(t *testing.T) {
	t.Parallel()
	done := make(chan struct{})
	close(done)
	require.NoError(t, Await(context.Background(), done, time.Hour))
	require.NoError(t, Await(context.Background(), make(chan struct{}), time.Millisecond), "a timeout is no error: the summary counts what is missing")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, Await(ctx, make(chan struct{}), time.Hour), context.Canceled)
}

// TestPauseReplayWithoutCluster: on servers the environment named there is
// nothing to pause, and stop returns at once, however often it is called.
func TestPauseReplayWithoutCluster(t *testing.T) {
	t.Parallel()
	s := &Services{}
	stop := s.PauseReplay(context.Background(), time.Second, nil)
	stop()
	stop()
}

func TestCreateTopicBeforeKafka(t *testing.T) {
	t.Parallel()
	require.Error(t, (&Services{}).CreateTopic(context.Background(), "t", 1))
}

// TestStartPostgres starts a throwaway primary with one replica, then
// connects to it by URL as an example does when the environment names the
// servers: no cluster of its own, and its Close leaves the servers up.
func TestStartPostgres(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	var progress strings.Builder
	own, err := StartPostgres(ctx, &progress, PostgresConfig{Replicas: 1, PrimaryEnv: "X_PRIMARY"})
	require.NoError(t, err)
	defer own.Close()
	require.NotNil(t, own.Cluster)
	require.Len(t, own.Replicas, 1)
	require.Contains(t, progress.String(), "one streaming replica (set X_PRIMARY to use your own)")

	progress.Reset()
	named, err := StartPostgres(ctx, &progress, PostgresConfig{
		PrimaryURL:  own.Primary.Config().ConnString(),
		ReplicaURLs: []string{" " + own.Replicas[0].Config().ConnString()},
	})
	require.NoError(t, err)
	require.Nil(t, named.Cluster)
	require.Len(t, named.Replicas, 1)
	require.Empty(t, progress.String(), "nothing started, nothing to say")
	var inRecovery bool
	require.NoError(t, named.Replicas[0].QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery))
	require.True(t, inRecovery)
	named.Close()
	require.NoError(t, own.Primary.Ping(ctx), "closing the named services stopped the servers")
}
