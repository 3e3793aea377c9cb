package testsvc

import (
	"fmt"
	"os"
	"os/user"
	"strconv"
	"sync"
	"syscall"
)

var serviceCred struct {
	once sync.Once
	cred *syscall.Credential
	err  error
}

// ServiceCredential is the identity of services that refuse to run as root
// (PostgreSQL, PgBouncer): nil, meaning our own, unless the effective uid
// is 0; then the user $PGTEST_USER, else "nobody". It is the same user for
// every harness, so that one PGTEST_USER setting serves them all. Start
// such a service with SysProcAttr.Credential set to it, in a Sandbox made
// traversable when it is not nil.
func ServiceCredential() (*syscall.Credential, error) {
	serviceCred.once.Do(func() {
		if os.Geteuid() != 0 {
			return
		}
		name := os.Getenv("PGTEST_USER")
		if name == "" {
			name = "nobody"
		}
		u, err := user.Lookup(name)
		if err != nil {
			serviceCred.err = fmt.Errorf("testsvc: running as root, so services must run as an unprivileged user, but user %q was not found: %w (set PGTEST_USER)", name, err)
			return
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil || uid == 0 {
			serviceCred.err = fmt.Errorf("testsvc: user %q (uid %s gid %s) cannot run services that refuse root (set PGTEST_USER)", name, u.Uid, u.Gid)
			return
		}
		// Empty Groups with NoSetGroups=false drops root's supplementary groups.
		serviceCred.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
	})
	return serviceCred.cred, serviceCred.err
}

// ChownService hands a path we created to the ServiceCredential user; it
// does nothing when that is us.
func ChownService(path string) error {
	c, err := ServiceCredential()
	if err != nil || c == nil {
		return err
	}
	return os.Chown(path, int(c.Uid), int(c.Gid))
}
