// Package fault injects network faults by wrapping real connections, in the
// manner of pgx's faultyconn and asynq's testbroker: the code under test
// dials through a Dialer, and the chaos harness cuts what it dialed or holds
// what it is about to dial. Nothing is simulated; the bytes always go to the
// real server.
//
//	d := fault.NewDialer(nil)
//	cfg.ConnConfig.DialFunc = d.DialContext    // pgx
//	dialer := &kafka.Dialer{DialFunc: d.DialContext} // kafka-go
//	...
//	d.Hold()  // new connections hang until Release (or their context ends)
//	d.Cut()   // every live connection is reset, as a crashed peer would
//
// Where the client cannot take a dialer (PgBouncer, HAProxy, a DSN given
// to another program), a Proxy listens in the server's place and applies
// the same faults from the other end; its SetTarget moves where new
// connections go, as a DNS name or a virtual IP moves.
package fault

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"
)

// ErrRefused is what dials return while the Dialer refuses them.
var ErrRefused = errors.New("fault: connection refused by fault injection")

// Dialer dials real connections and can cut them, hold new ones or refuse
// them. It is safe for concurrent use.
type Dialer struct {
	next func(ctx context.Context, network, addr string) (net.Conn, error)

	mu      sync.Mutex
	conns   map[*conn]struct{}
	refuse  bool
	held    chan struct{} // closed on Release; nil while not holding
	dials   int
	holding int
}

// NewDialer returns a Dialer that dials with next, or a net.Dialer with a
// 5s timeout when next is nil.
func NewDialer(next func(ctx context.Context, network, addr string) (net.Conn, error)) *Dialer {
	if next == nil {
		nd := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
		next = nd.DialContext
	}
	return &Dialer{next: next, conns: map[*conn]struct{}{}}
}

// DialContext has the signature of net.Dialer.DialContext, pgconn's DialFunc
// and kafka-go's Dialer.DialFunc.
func (d *Dialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	d.mu.Lock()
	refuse, held := d.refuse, d.held
	if held != nil {
		d.holding++
	}
	d.mu.Unlock()
	if refuse {
		return nil, &net.OpError{Op: "dial", Net: network, Err: ErrRefused}
	}
	if held != nil {
		// A held dial is a SYN nobody answers: it hangs until the fault
		// ends or the caller gives up, whichever comes first.
		select {
		case <-held:
		case <-ctx.Done():
		}
		d.mu.Lock()
		d.holding--
		refuse = d.refuse
		d.mu.Unlock()
		if err := ctx.Err(); err != nil {
			return nil, &net.OpError{Op: "dial", Net: network, Err: err}
		}
		if refuse {
			return nil, &net.OpError{Op: "dial", Net: network, Err: ErrRefused}
		}
	}
	c, err := d.next(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	fc := &conn{Conn: c, d: d}
	d.mu.Lock()
	d.conns[fc] = struct{}{}
	d.dials++
	d.mu.Unlock()
	return fc, nil
}

// Cut resets every live connection the Dialer made, as a crashed peer or a
// dropped link would, and returns how many it cut. Dials in progress are
// not affected.
func (d *Dialer) Cut() int {
	d.mu.Lock()
	conns := make([]*conn, 0, len(d.conns))
	for c := range d.conns {
		conns = append(conns, c)
	}
	d.mu.Unlock()
	for _, c := range conns {
		if tc, ok := c.Conn.(*net.TCPConn); ok {
			// Linger 0 sends RST instead of FIN: the peer sees a reset
			// connection, not an orderly goodbye.
			_ = tc.SetLinger(0)
		}
		_ = c.Close()
	}
	return len(conns)
}

// Refuse makes new dials fail at once (true) or work again (false).
func (d *Dialer) Refuse(on bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.refuse = on
}

// Hold makes new dials hang until Release or until their context ends.
// Live connections keep working.
func (d *Dialer) Hold() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.held == nil {
		d.held = make(chan struct{})
	}
}

// Release lets held and future dials through.
func (d *Dialer) Release() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.held != nil {
		close(d.held)
		d.held = nil
	}
}

// Stats reports the connections dialed so far, those still open and the
// dials being held right now.
func (d *Dialer) Stats() (dialed, open, holding int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dials, len(d.conns), d.holding
}

type conn struct {
	net.Conn
	d    *Dialer
	once sync.Once
}

func (c *conn) Close() error {
	c.once.Do(func() {
		c.d.mu.Lock()
		delete(c.d.conns, c)
		c.d.mu.Unlock()
	})
	return c.Conn.Close()
}
