package fault

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
)

// Proxy is a TCP forwarder on a loopback port that the code under test
// connects to in place of the server, for clients a Dialer cannot wrap
// (PgBouncer, HAProxy, a DSN handed to another program). It models what a
// DNS name, a virtual IP or a Kubernetes Service does between a pool and
// its servers: each new connection goes to the current target, and
// SetTarget moves only the connections made after it, since an
// established TCP connection keeps the server it reached. The upstream
// side is a Dialer, so Refuse, Blackhole and Cut are the Dialer's faults
// seen from the client's end of the proxy.
//
//	p, err := fault.NewProxy(replica1.Addr())
//	dsn := "postgres://postgres@" + p.Addr() + "/db"
//	p.SetTarget(replica2.Addr()) // new connections reach replica2
//	p.Blackhole()                // new connections hang: a replica this process cannot reach
//
// It is safe for concurrent use.
type Proxy struct {
	ln     net.Listener
	d      *Dialer
	ctx    context.Context // ends held dials on Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu       sync.Mutex
	target   string
	clients  map[net.Conn]struct{}
	accepted int
	closed   bool
}

// NewProxy listens on a free port of 127.0.0.1 and forwards to target
// (host:port).
func NewProxy(target string) (*Proxy, error) {
	return ListenProxy("127.0.0.1:0", target)
}

// ListenProxy is NewProxy on a chosen address, e.g. 127.0.0.2:port: a
// program that takes one port for several hosts (PgBouncer's host list)
// needs proxies that differ only in address.
func ListenProxy(listen, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("fault: proxy: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{ln: ln, d: NewDialer(nil), ctx: ctx, cancel: cancel, target: target, clients: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// Addr is the host:port clients connect to.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target is where new connections go.
func (p *Proxy) Target() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.target
}

// SetTarget sends the connections accepted from now on to addr; those
// already forwarded keep their server, as after a DNS or VIP move.
func (p *Proxy) SetTarget(addr string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.target = addr
}

// Refuse makes new connections, and those Blackhole is holding, end at
// once: accepted, then reset before a byte is forwarded, which is what a
// client sees from a balancer that has no server to give it. (A stopped
// pgtest node gives the other kind of refusal, ECONNREFUSED.) Live
// connections keep working.
func (p *Proxy) Refuse() {
	// Refusing before releasing makes the held dials see the refusal.
	p.d.Refuse(true)
	p.d.Release()
}

// Blackhole makes new connections hang: accepted but never forwarded, as
// for a server behind a dropped route, until Accept (they are then
// forwarded, as a retransmitted SYN gets through once the route is back),
// Refuse, or the client's own timeout. Live connections keep working.
func (p *Proxy) Blackhole() {
	p.d.Refuse(false)
	p.d.Hold()
}

// Accept undoes Refuse and Blackhole: new and held connections are
// forwarded again.
func (p *Proxy) Accept() {
	p.d.Refuse(false)
	p.d.Release()
}

// Cut resets every forwarded connection on both sides, as a crashed peer
// or a dropped link would, and returns how many client connections it
// cut. New connections are not affected.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	clients := make([]net.Conn, 0, len(p.clients))
	for c := range p.clients {
		clients = append(clients, c)
	}
	p.mu.Unlock()
	for _, c := range clients {
		reset(c)
	}
	p.d.Cut()
	return len(clients)
}

// Stats reports the connections accepted so far, those being forwarded
// right now and those Blackhole is holding.
func (p *Proxy) Stats() (accepted, forwarding, held int) {
	_, open, held := p.d.Stats()
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted, open, held
}

// Close stops listening, ends every connection and waits for the
// forwarding goroutines; idempotent.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	clients := make([]net.Conn, 0, len(p.clients))
	for c := range p.clients {
		clients = append(clients, c)
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.cancel()
	for _, c := range clients {
		_ = c.Close()
	}
	p.d.Cut()
	p.wg.Wait()
	return err
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // EMFILE and the like: the next Accept may work
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = c.Close()
			return
		}
		p.accepted++
		p.clients[c] = struct{}{}
		target := p.target
		p.wg.Add(1)
		p.mu.Unlock()
		go p.forward(c, target)
	}
}

// forward connects c to target, chosen when c was accepted: a held
// connection released later still goes where its client was sent.
func (p *Proxy) forward(c net.Conn, target string) {
	defer p.wg.Done()
	defer func() {
		p.mu.Lock()
		delete(p.clients, c)
		p.mu.Unlock()
	}()
	up, err := p.d.DialContext(p.ctx, "tcp", target)
	if err != nil {
		// Refused, the target is down, or Close: the client learns at
		// once rather than by a timeout.
		reset(c)
		return
	}
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		done <- struct{}{}
	}
	go pipe(up, c)
	go pipe(c, up)
	// Either side ending ends both: PostgreSQL's protocol has no use for a
	// half-closed connection, and a client must see its server go away.
	<-done
	_ = c.Close()
	_ = up.Close()
	<-done
}

// reset closes c with a RST rather than a FIN, so the peer sees a reset
// connection, not an orderly goodbye.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}
