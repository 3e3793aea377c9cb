package kafkatest_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/internal/kafkatest"
	"github.com/caughtup/caughtup/internal/testsvc"
)

// helperEnv makes the test binary act as a "test binary that dies": it
// starts a broker and a Connect worker, reports where they live, then waits
// to be killed.
const helperEnv = "KAFKATEST_CLEANUP_HELPER"

func helperMain(string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b, err := kafkatest.Start(ctx, kafkatest.Options{Local: true})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	c, err := kafkatest.StartConnect(ctx, b.Brokers(), kafkatest.ConnectOptions{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	fmt.Printf("READY %s %s\n", b.Dir(), c.Dir())
	time.Sleep(time.Hour)
	return 0
}

// TestCleanupWhenTestBinaryDies SIGKILLs a test binary that runs a broker
// and a Connect worker: the watchdogs must kill both JVMs and remove their
// directories. (pgtest tests SIGTERM and panics for the shared mechanism.)
func TestCleanupWhenTestBinaryDies(t *testing.T) {
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=kill")
	out, w, err := os.Pipe()
	require.NoError(t, err)
	cmd.Stdout = w
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	_ = w.Close()
	waited := false
	defer func() {
		if !waited {
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
	case <-time.After(5 * time.Minute):
		t.Fatal("helper did not report READY")
	}
	fields := strings.Fields(line)
	require.Len(t, fields, 3, "helper said %q (exit: see stderr after it dies)", line)
	dirs := fields[1:]
	before := testsvc.ProcessesIn(dirs)
	require.Len(t, before, 2, "a broker JVM and a Connect JVM in %v", dirs)

	began := time.Now()
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	waited = true
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
	}, 20*time.Second, 20*time.Millisecond, "left behind: processes %v; helper stderr:\n%s", testsvc.ProcessesIn(dirs), stderr.String())
	t.Logf("JVMs %v and %v gone %v after the test binary was SIGKILLed", before, dirs, time.Since(began).Round(time.Millisecond))
}
