package pgtest

import (
	"bufio"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// newSandbox makes a temporary directory with a watchdog (see
// testkit/testsvc) that the PostgreSQL service user can traverse when we
// are root.
func newSandbox(prefix string) (*testsvc.Sandbox, error) {
	c, err := serviceCredential()
	if err != nil {
		return nil, err
	}
	return testsvc.NewSandbox(prefix, c != nil)
}

// freeSharedMemory frees the SysV segment a SIGKILLed postmaster leaves
// behind; otherwise every crash test would leak one until the next reboot.
// postmaster.pid line 7 holds "key shmid".
func freeSharedMemory(dataDir string) {
	f, err := os.Open(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for i := 1; sc.Scan(); i++ {
		if i != 7 {
			continue
		}
		fields := strings.Fields(sc.Text())
		if len(fields) == 2 {
			if id, err := strconv.Atoi(fields[1]); err == nil && id >= 0 {
				const ipcRMID = 0
				_, _, _ = syscall.Syscall(syscall.SYS_SHMCTL, uintptr(id), ipcRMID, 0)
			}
		}
		return
	}
}

// errClosed is returned by operations on a closed Cluster or Redis, e.g.
// after the signal handler closed them under a running test.
var errClosed = errors.New("pgtest: closed (by Close or by the SIGINT/SIGTERM handler)")
