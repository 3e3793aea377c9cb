package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// helperEnv makes the test binary clusterHelper, the command that
// TestClusterRunsCommand runs under the cluster.
const helperEnv = "CAUGHTUP_DEMO_CLUSTER_HELPER"

// clusterHelper checks the environment the cluster gave it: a primary, two
// replicas in recovery, a Redis that answers. It prints what it found and
// exits 3, so that the test sees the status passed on.
func clusterHelper() int {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	inRecovery := func(url string) (bool, error) {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return false, err
		}
		defer func() { _ = conn.Close(ctx) }()
		var r bool
		err = conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&r)
		return r, err
	}
	primary, err := inRecovery(os.Getenv("CAUGHTUP_PRIMARY_URL"))
	if err != nil || primary {
		fmt.Println("primary:", primary, err)
		return 1
	}
	replicas := strings.Split(os.Getenv("CAUGHTUP_REPLICA_URLS"), ",")
	for _, u := range replicas {
		if r, err := inRecovery(u); err != nil || !r {
			fmt.Println("replica:", r, err)
			return 1
		}
	}
	conn, err := net.Dial("tcp", os.Getenv("REDIS_ADDR"))
	if err != nil {
		fmt.Println("redis:", err)
		return 1
	}
	_ = conn.Close()
	fmt.Printf("primary ok, %d replicas in recovery, redis ok, kafka %q\n", len(replicas), os.Getenv("KAFKA_BROKERS"))
	return 3
}

// TestClusterRunsCommand runs a command under `caughtup-demo cluster` with
// replay pausing at random: it finds the services in its environment, and
// its exit status is the subcommand's.
func TestClusterRunsCommand(t *testing.T) {
	t.Setenv(helperEnv, "1")
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), []string{"cluster", "-max-pause", "200ms", "--", os.Args[0]}, &stdout, &stderr)
	t.Logf("stderr:\n%s", stderr.String())
	require.Equal(t, 3, code, "stdout: %s", stdout.String())
	require.Equal(t, "primary ok, 2 replicas in recovery, redis ok, kafka \"\"\n", stdout.String())
	require.Contains(t, stderr.String(), "replay pauses at random for up to 200ms at a time")
}

func TestClusterBadFlags(t *testing.T) {
	for _, args := range [][]string{{"-nonsense"}, {"-max-pause", "-1s"}} {
		var stdout, stderr bytes.Buffer
		require.Equal(t, 2, run(context.Background(), append([]string{"cluster"}, args...), &stdout, &stderr), "args %q", args)
		require.Empty(t, stdout.String())
	}
}
