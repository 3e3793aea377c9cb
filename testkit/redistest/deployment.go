package redistest

import (
	"errors"
	"sync"
	"syscall"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// deployment is what every harness of the package (Cluster, Sentinel,
// Standalone) is made of: the machine's redis-server, a sandbox, the
// servers in it, and a place among what the SIGINT/SIGTERM handler closes.
type deployment struct {
	bin  string
	sb   *testsvc.Sandbox
	cred *syscall.Credential // whom the servers run as; nil: as the test binary

	mu         sync.Mutex
	servers    []*Server // in the order they were added
	unregister func()
	closed     bool
}

// newDeployment finds redis-server and makes the sandbox, named after
// prefix, whose servers run as the unprivileged service user when the test
// binary is root, or as the test binary itself when asCaller. Its close
// runs on SIGINT/SIGTERM until it has run once.
func newDeployment(prefix string, asCaller bool) (*deployment, error) {
	bin, err := redisBinary()
	if err != nil {
		return nil, err
	}
	var cred *syscall.Credential
	if !asCaller {
		if cred, err = testsvc.ServiceCredential(); err != nil {
			return nil, err
		}
	}
	sb, err := newSandbox(prefix)
	if err != nil {
		return nil, err
	}
	d := &deployment{bin: bin, sb: sb, cred: cred}
	unregister := testsvc.Register(d.close)
	d.mu.Lock()
	d.unregister = unregister
	d.mu.Unlock()
	return d, nil
}

// add makes the server named name (its directory in the sandbox, its name
// in errors) with the command line args gives for a port; close stops it.
func (d *deployment) add(name string, args func(port int) []string) (*Server, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, errClosed
	}
	s, err := newServer(d.sb, d.bin, name, d.cred, args)
	if err != nil {
		return nil, err
	}
	d.servers = append(d.servers, s)
	return s, nil
}

// close kills every server, the last added first, and removes the
// sandbox; idempotent.
func (d *deployment) close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	servers, unregister := d.servers, d.unregister
	d.mu.Unlock()
	var errs []error
	for i := len(servers) - 1; i >= 0; i-- {
		errs = append(errs, servers[i].close())
	}
	errs = append(errs, d.sb.Remove())
	if unregister != nil {
		unregister()
	}
	return errors.Join(errs...)
}
