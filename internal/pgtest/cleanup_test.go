package pgtest_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/internal/pgtest"
	"github.com/caughtup/caughtup/internal/testsvc"
)

// helperEnv makes the test binary act as a "test binary that dies": it starts
// services, reports where they live, then waits to be killed or told to panic.
const helperEnv = "PGTEST_CLEANUP_HELPER"

func helperMain(mode string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	replicas := -1
	if mode == "kill" {
		replicas = 1
	}
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: replicas})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	r, err := pgtest.StartRedis(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	fmt.Printf("READY %s %s\n", c.Dir(), r.Dir())
	// Block until the parent says "go" (or forever, for signals).
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	if mode == "panic" {
		// What `go test -timeout` does: panic, no deferred cleanup.
		panic("pgtest cleanup helper: simulated test panic")
	}
	time.Sleep(time.Hour)
	return 0
}

// lockedBuffer collects the helper's stderr, which os/exec copies from
// another goroutine while failure messages read it.
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

func TestCleanupWhenTestBinaryDies(t *testing.T) {
	for _, mode := range []string{"kill", "term", "panic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), helperEnv+"="+mode)
			stdin, err := cmd.StdinPipe()
			require.NoError(t, err)
			out, w, err := os.Pipe()
			require.NoError(t, err)
			cmd.Stdout = w
			var stderr lockedBuffer
			cmd.Stderr = &stderr
			require.NoError(t, cmd.Start())
			_ = w.Close()
			killed := false
			defer func() {
				if !killed {
					_ = cmd.Process.Kill()
					_ = cmd.Wait()
				}
				_ = out.Close()
			}()

			lines := make(chan string, 1)
			go func() {
				br := bufio.NewReader(out)
				line, _ := br.ReadString('\n')
				lines <- line
				_, _ = io.Copy(io.Discard, br)
			}()
			var line string
			select {
			case line = <-lines:
			case <-time.After(60 * time.Second):
				t.Fatalf("helper did not report READY; stderr:\n%s", stderr.String())
			}
			fields := strings.Fields(line)
			require.Len(t, fields, 3, "helper said %q; stderr:\n%s", line, stderr.String())
			require.Equal(t, "READY", fields[0])
			dirs := fields[1:]
			before := testsvc.ProcessesIn(dirs)
			// kill: primary + replica postmasters and their children, redis.
			require.GreaterOrEqual(t, len(before), 3, "processes in %v", dirs)
			for _, d := range dirs {
				require.DirExists(t, d)
			}

			began := time.Now()
			switch mode {
			case "kill":
				require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
			case "term":
				require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
			case "panic":
				_, err := io.WriteString(stdin, "go\n")
				require.NoError(t, err)
			}
			waitErr := cmd.Wait()
			killed = true
			t.Logf("helper (%d processes in %v) exited: %v", len(before), dirs, waitErr)
			require.Error(t, waitErr)

			require.Eventually(t, func() bool {
				if len(testsvc.ProcessesIn(dirs)) > 0 {
					return false
				}
				for _, d := range dirs {
					if _, err := os.Stat(d); !os.IsNotExist(err) {
						return false
					}
				}
				return true
			}, 10*time.Second, 20*time.Millisecond, "left behind: processes %v; stderr:\n%s", testsvc.ProcessesIn(dirs), stderr.String())
			t.Logf("everything gone %v after the helper died", time.Since(began).Round(time.Millisecond))
		})
	}
}
