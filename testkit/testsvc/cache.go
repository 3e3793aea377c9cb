package testsvc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// CacheDir is where the harnesses keep what they download (jars, server
// binaries), outside the repository so that every worktree and every clean
// checkout shares one copy: $CAUGHTUP_CACHE, else
// $XDG_CACHE_HOME/caughtup, else ~/.cache/caughtup.
func CacheDir() (string, error) {
	if d := os.Getenv("CAUGHTUP_CACHE"); d != "" {
		return d, nil
	}
	d, err := os.UserCacheDir() // $XDG_CACHE_HOME, else ~/.cache
	if err != nil {
		return "", fmt.Errorf("no cache directory (%w); set CAUGHTUP_CACHE", err)
	}
	return filepath.Join(d, "caughtup"), nil
}

// LockFile takes an exclusive flock on path (created if missing), for
// harnesses that fill a cache directory which several test binaries may
// reach at once. It polls so that ctx can end the wait (flock itself cannot
// be interrupted); what names the work in the messages, and logf (nil
// discards) hears once that another process holds the lock. The lock dies
// with the process, so a killed holder never blocks the next one.
func LockFile(ctx context.Context, path, what string, logf func(string, ...any)) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o644)
	if err != nil {
		return nil, err
	}
	said := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() {
				_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
				_ = f.Close()
			}, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			_ = f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if !said && logf != nil {
			logf("another process is %s; waiting for %s", what, path)
			said = true
		}
		if err := SleepCtx(ctx, 200*time.Millisecond); err != nil {
			_ = f.Close()
			return nil, fmt.Errorf("waited too long for another process %s (lock %s): %w", what, path, err)
		}
	}
}
