package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, pgtest.Options{})) }

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestHelpOnEveryCommand(t *testing.T) {
	t.Parallel()
	code, out, _ := runCLI(t, "--help")
	require.Equal(t, 0, code)
	for _, c := range commands() {
		require.Contains(t, out, c.name)
		code, out, errOut := runCLI(t, c.name, "--help")
		require.Equal(t, 0, code, "%s --help: %s", c.name, errOut)
		require.Contains(t, out, "usage: caughtup "+c.name)
	}
	for _, sub := range []string{"decode", "encode"} {
		code, out, _ := runCLI(t, "token", sub, "--help")
		require.Equal(t, 0, code)
		require.Contains(t, out, "usage: caughtup token "+sub)
	}
	code, _, errOut := runCLI(t, "nonsense")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "unknown command")
}

func TestTokenEncodeDecodeRoundTrip(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "token", "encode", "--database", "main", "--system-id", "7301234567890123456",
		"--timeline", "2", "--lsn", "16/B374D848", "--source", "replica", "--captured-at", "2026-11-29T10:00:00Z")
	require.Equal(t, 0, code, errOut)
	text := strings.TrimSpace(out)
	code, out, errOut = runCLI(t, "token", "decode", text)
	require.Equal(t, 0, code, errOut)
	var got struct {
		Version    int              `json:"version"`
		CapturedAt string           `json:"captured_at"`
		Entries    []position.Entry `json:"entries"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &got))
	require.Equal(t, 1, got.Version)
	require.Equal(t, "2026-11-29T10:00:00Z", got.CapturedAt)
	require.Equal(t, []position.Entry{{Database: "main", Epoch: position.Epoch{SystemID: 7301234567890123456, Timeline: 2},
		LSN: position.MustParseLSN("16/B374D848"), Source: position.SourceReplica}}, got.Entries)
	require.Contains(t, out, "\n  \"entries\"", "indented JSON")
}

// Every malformed token gets exit status 2 and exactly one line on stderr,
// never a panic.
func TestTokenDecodeMalformed(t *testing.T) {
	t.Parallel()
	valid, err := position.New("main", position.Epoch{SystemID: 99, Timeline: 1}, 0x16B3740, position.SourcePrimary, time.UnixMilli(1_800_000_000_000)).Encode()
	require.NoError(t, err)
	inputs := []string{"", "v1", "v2;0;main=p.1.1.0/1", "v1;0;main=p.1.1.0/1;main=p.1.1.0/2", "v1;0;main=p.1.1.0/1\nsecond line",
		"v1;0;ma\x00in=p.1.1.0/1", "\x1b[31mred", strings.Repeat("x", 5000), "v1;0;main=p.FFFFFFFFFFFFFFFFF.1.0/1"}
	rng := rand.New(rand.NewPCG(3, 4))
	for len(inputs) < 300 {
		b := []byte(valid)
		b[rng.IntN(len(b))] = byte(rng.IntN(256))
		if _, err := position.Decode(string(b)); err != nil {
			inputs = append(inputs, string(b))
		}
	}
	for _, in := range inputs {
		code, out, errOut := runCLI(t, "token", "decode", in)
		require.Equal(t, exitUsage, code, "input %q", in)
		require.Empty(t, out)
		require.Equal(t, 1, strings.Count(errOut, "\n"), "one line for %q: %q", in, errOut)
		require.True(t, strings.HasSuffix(errOut, "\n"))
	}
	code, _, errOut := runCLI(t, "token", "decode", "a", "b")
	require.Equal(t, exitUsage, code, errOut)
}

func TestTokenEncodeRejectsBadFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"--system-id", "x", "--lsn", "0/1"},
		{"--system-id", "1", "--lsn", "zz"},
		{"--system-id", "1", "--lsn", "0/1", "--database", "bad name"},
		{"--system-id", "1", "--lsn", "0/1", "--timeline", "0"},
		{"--system-id", "1", "--lsn", "0/1", "--source", "nope"},
		{"--bogus"},
	} {
		code, _, errOut := runCLI(t, append([]string{"token", "encode"}, args...)...)
		require.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
	// A missing flag is named as missing, not as malformed.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "caughtup token: --system-id and --lsn are required"},
		{[]string{"--lsn", "0/1"}, "caughtup token: --system-id is required"},
		{[]string{"--system-id", "1"}, "caughtup token: --lsn is required"},
		{[]string{"--system-id", "x", "--lsn", "0/1"}, `caughtup token: --system-id "x": want a decimal number`},
	} {
		code, out, errOut := runCLI(t, append([]string{"token", "encode"}, tc.args...)...)
		require.Equal(t, exitUsage, code, "%v: %s", tc.args, errOut)
		require.Empty(t, out)
		require.True(t, strings.HasPrefix(errOut, tc.want), "%v: %q", tc.args, errOut)
		require.Equal(t, 1, strings.Count(errOut, "\n"), "%v: one line: %q", tc.args, errOut)
	}
}

// TestWatchShowsReplicas: watch takes replicas as feed and doctor do:
// bare URLs, named host:port, and NAME=URL, named NAME (not a key=value
// string read as a runtime parameter on the local socket).
func TestWatchShowsReplicas(t *testing.T) {
	c := pgtest.Shared(t)
	for _, named := range []bool{false, true} {
		args := []string{"watch", "--primary", c.Primary().DSN(""), "--interval", "50ms", "--count", "2"}
		var names []string
		for i, r := range c.Replicas() {
			arg, name := r.DSN(""), fmt.Sprintf("127.0.0.1:%d", r.Port())
			if named {
				name = fmt.Sprintf("r%d", i+1)
				arg = name + "=" + arg
			}
			args = append(args, "--replica", arg)
			names = append(names, name)
		}
		code, out, errOut := runCLI(t, args...)
		require.Equal(t, 0, code, errOut)
		require.Equal(t, 2, strings.Count(out, "snapshot #"))
		require.Equal(t, 2*len(c.Replicas()), strings.Count(out, " replica "), out)
		require.NotContains(t, out, "unusable", out)
		for _, name := range names {
			require.Equal(t, 2, strings.Count(out, "\n"+name+" "), "replica %s in each refresh: %s", name, out)
		}
	}

	code, _, errOut := runCLI(t, "watch", "--primary", c.Primary().DSN(""), "--replica", "r1=host=127.0.0.1 port=1")
	require.Equal(t, exitUsage, code, "a named key=value string is refused: %s", errOut)
	require.Contains(t, errOut, "a named replica is NAME=postgres://")

	code, _, _ = runCLI(t, "watch", "--primary", c.Primary().DSN(""))
	require.Equal(t, exitUsage, code, "watch without replicas is a usage error")
}

// TestFeedPublishes runs `caughtup feed` against the shared cluster and
// Redis and reads its signed observations of every node with a
// subscriber holding the key.
func TestFeedPublishes(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	rs := pgtest.SharedRedis(t)
	code, out, errOut := runCLI(t, "feed", "--generate-key", "k1")
	require.Equal(t, 0, code, errOut)
	keys, err := feed.ParseKeys(strings.TrimSpace(out))
	require.NoError(t, err)
	keysFile := filepath.Join(t.TempDir(), "keys")
	require.NoError(t, os.WriteFile(keysFile, []byte(out), 0o600))

	name := fmt.Sprintf("cli-%d", time.Now().UnixNano())
	args := []string{"feed", "--primary", c.Primary().DSN(""), "--redis", "redis://" + rs.Addr() + "/0",
		"--feed", name, "--name", "cli", "--keys-file", keysFile, "--interval", "20ms"}
	for i, r := range c.Replicas() {
		args = append(args, "--replica", fmt.Sprintf("r%d=%s", i+1, r.DSN("")))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout, stderr bytes.Buffer
	done := make(chan int, 1)
	go func() { done <- run(ctx, args, &stdout, &stderr) }()

	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr()})
	defer rdb.Close()
	var mu sync.Mutex
	nodes := make(map[string]bool)
	sub, err := feed.NewSubscriber(feed.SubscriberConfig{Client: rdb, Feed: name, Keys: feed.Keyring{Keys: keys},
		OnObservation: func(d feed.Delivery) {
			if d.Err == "" {
				mu.Lock()
				nodes[d.Role.String()+":"+d.Node] = true
				mu.Unlock()
			}
		}})
	require.NoError(t, err)
	subCtx, stopSub := context.WithCancel(context.Background())
	subDone := make(chan struct{})
	go func() { _ = sub.Run(subCtx); close(subDone) }()
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return nodes["primary:"] && nodes["replica:r1"] && nodes["replica:r2"]
	}, 30*time.Second, 10*time.Millisecond, "observations of every node")
	stopSub()
	<-subDone
	cancel()
	select {
	case code := <-done:
		require.Equal(t, 0, code, stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatal("caughtup feed did not stop on interrupt")
	}
	require.Contains(t, stdout.String(), `publishing database "main"`)
}

func TestFeedRejectsBadFlags(t *testing.T) {
	t.Setenv("CAUGHTUP_FEED_KEYS", "")
	for _, args := range [][]string{
		{},
		{"--primary", "postgres://x/y"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y"}, // no keys
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--insecure", "--redis-mode", "ring"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--insecure", "--redis", "http://x"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--insecure", "--redis-mode", "sentinel"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--insecure", "--interval", "0s"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--insecure", "--heartbeat", "0s"},
		{"--generate-key", "bad id{"},
	} {
		code, _, errOut := runCLI(t, append([]string{"feed"}, args...)...)
		require.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
}
