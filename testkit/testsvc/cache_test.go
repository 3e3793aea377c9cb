package testsvc

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestLockFile: a second resolver (another test binary; here another open
// file description, which flock treats the same way) waits for the first
// and gives up when its context ends.
func TestLockFile(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), ".lock")
	unlock, err := LockFile(context.Background(), path, "testing", t.Logf)
	require.NoError(t, err)

	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = LockFile(short, path, "testing", t.Logf)
	require.ErrorIs(t, err, context.DeadlineExceeded)

	got := make(chan error, 1)
	go func() {
		u, err := LockFile(context.Background(), path, "testing", nil)
		if err == nil {
			u()
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("second lock taken while the first is held (err %v)", err)
	case <-time.After(300 * time.Millisecond):
	}
	unlock()
	select {
	case err := <-got:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("second lock not taken after the first was released")
	}
}
