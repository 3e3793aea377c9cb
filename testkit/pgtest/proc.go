package pgtest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// installHint ends every "could not run PostgreSQL" error so that whoever
// reads a CI log knows where to look next.
const installHint = "is postgresql-15 installed (or CAUGHTUP_PG_VERSION set to 16, 17 or 18)? run scripts/install-deps, see .ci/run"

var (
	credOnce sync.Once
	cred     *syscall.Credential
	credErr  error
)

// serviceCredential is the identity PostgreSQL programs run as: nil (our own)
// unless we are root, which postgres refuses.
func serviceCredential() (*syscall.Credential, error) {
	credOnce.Do(func() {
		if os.Geteuid() != 0 {
			return
		}
		name := os.Getenv("PGTEST_USER")
		if name == "" {
			name = "nobody"
		}
		u, err := user.Lookup(name)
		if err != nil {
			credErr = fmt.Errorf("pgtest: running as root, so PostgreSQL must run as an unprivileged user, but user %q was not found: %w (set PGTEST_USER)", name, err)
			return
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil || uid == 0 {
			credErr = fmt.Errorf("pgtest: user %q (uid %s gid %s) cannot run PostgreSQL (set PGTEST_USER)", name, u.Uid, u.Gid)
			return
		}
		// Empty Groups with NoSetGroups=false drops root's supplementary groups.
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
	})
	return cred, credErr
}

// chownService hands a path we created to the service user.
func chownService(path string) error {
	c, err := serviceCredential()
	if err != nil || c == nil {
		return err
	}
	return os.Chown(path, int(c.Uid), int(c.Gid))
}

// mkdirService creates a 0700 directory owned by the service user.
func mkdirService(path string) error {
	if err := os.Mkdir(path, 0o700); err != nil {
		return err
	}
	return chownService(path)
}

// writeServiceFile writes a file PostgreSQL must be able to read or remove.
func writeServiceFile(path string, data []byte) error {
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return err
	}
	return chownService(path)
}

// serviceEnv is a clean environment: inherited PGHOST/PGPORT/PGDATA or a
// locale the server does not know would change what the programs do.
func serviceEnv(home string) []string {
	path := os.Getenv("PATH")
	if path == "" {
		path = "/usr/local/bin:/usr/bin:/bin"
	}
	env := []string{"PATH=" + path, "HOME=" + home, "LC_ALL=C", "LANG=C"}
	if tz, ok := os.LookupEnv("TZ"); ok {
		env = append(env, "TZ="+tz)
	}
	return env
}

// serviceCmd prepares a PostgreSQL program. Setpgid keeps a terminal's
// Ctrl-C (sent to the foreground process group) away from the servers, so the
// test binary's own handler decides the order of shutdown.
func serviceCmd(dir string, prog string, args ...string) (*exec.Cmd, error) {
	bin, err := pgBinDir()
	if err != nil {
		return nil, err
	}
	return serviceCmdIn(bin, dir, prog, args...)
}

// serviceCmdIn is serviceCmd for the programs in bin, for ServerVersion,
// which checks them before they become the harness's.
func serviceCmdIn(bin, dir string, prog string, args ...string) (*exec.Cmd, error) {
	c, err := serviceCredential()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(bin, prog), args...)
	cmd.Dir = dir
	cmd.Env = serviceEnv(dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: c}
	return cmd, nil
}

// runService runs a short-lived PostgreSQL program to completion and returns
// its combined output; ctx cancellation kills it.
func runService(ctx context.Context, dir, prog string, args ...string) ([]byte, error) {
	cmd, err := serviceCmd(dir, prog, args...)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		err = ctx.Err()
	}
	return out.Bytes(), err
}

// killTree SIGKILLs a postmaster and its children. Postmaster children call
// setsid(), so a process-group kill would miss them; stopping the
// postmaster first keeps it from forking new ones while we enumerate.
func killTree(p *testsvc.Process) {
	if p.Exited() {
		return
	}
	_ = syscall.Kill(p.PID(), syscall.SIGSTOP)
	kids := testsvc.ChildrenOf(p.PID())
	_ = syscall.Kill(p.PID(), syscall.SIGKILL)
	for _, k := range kids {
		_ = syscall.Kill(k, syscall.SIGKILL)
	}
	p.Wait(10 * time.Second)
	deadline := time.Now().Add(5 * time.Second)
	for _, k := range kids {
		for testsvc.Alive(k) && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
}
