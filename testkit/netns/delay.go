package netns

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Delay holds every packet between the namespace and the root namespace's
// port, each way, for delay ± jitter (uniform; packets overtake one
// another as they do under tc netem's jitter), until heal is called.
//
// tc netem is the usual tool, and the kernels of this project's machines
// are built without it (sch_netem). The packets are queued to this
// process instead (iptables' NFQUEUE target in the namespace's mangle
// table, through iptables-legacy: nftables' own queue statement is not
// built in either) and accepted once their time has come, in the kernel
// path they were on: TCP sees the delay as on a slow link, retransmits
// and all. Add Lose for loss beside it. A packet that arrives while
// nothing reads the queue (after heal, or if this process dies) passes
// at once (--queue-bypass, fail-open).
func (n *Namespace) Delay(port int, delay, jitter time.Duration) (heal func() error, err error) {
	if delay < 0 || jitter < 0 || jitter > delay {
		return nil, fmt.Errorf("netns: delay %v ± %v: want 0 ≤ jitter ≤ delay", delay, jitter)
	}
	if _, err := exec.LookPath("iptables-legacy"); err != nil {
		return nil, fmt.Errorf("netns: Delay needs iptables-legacy (Debian: apt-get install iptables): %w", err)
	}
	n.mu.Lock()
	n.queues++
	num := uint16(n.k*100 + n.queues%100)
	n.mu.Unlock()
	q, err := n.openQueue(num)
	if err != nil {
		return nil, err
	}
	q.delay, q.jitter = delay, jitter
	go q.serve()
	port16 := strconv.Itoa(port)
	rules := [][]string{
		{"OUTPUT", "-d", n.hostIP, "-p", "tcp", "--dport", port16},
		{"INPUT", "-s", n.hostIP, "-p", "tcp", "--sport", port16},
	}
	iptables := func(op string, rule []string) error {
		args := append([]string{"ip", "netns", "exec", n.name, "iptables-legacy", "-w", "-t", "mangle", op}, rule...)
		return run(nil, append(args, "-j", "NFQUEUE", "--queue-num", strconv.Itoa(int(num)), "--queue-bypass")...)
	}
	var added [][]string
	removeRules := func() error {
		var errs []error
		for _, r := range added {
			errs = append(errs, iptables("-D", r))
		}
		added = nil
		return errors.Join(errs...)
	}
	for _, r := range rules {
		if err := iptables("-A", r); err != nil {
			q.stop(0)
			return nil, errors.Join(err, removeRules())
		}
		added = append(added, r)
	}
	var once sync.Once
	return func() error {
		var err error
		once.Do(func() {
			// No new packets, then the held ones at their time, then the
			// queue goes.
			err = removeRules()
			q.stop(delay + jitter)
			err = errors.Join(err, q.err())
		})
		return err
	}, nil
}

// Netlink constants of nfnetlink_queue (linux/netfilter/nfnetlink_queue.h).
const (
	nfnlSubsysQueue    = 3
	nfqnlMsgPacket     = 0
	nfqnlMsgVerdict    = 1
	nfqnlMsgConfig     = 2
	nfqaPacketHdr      = 1
	nfqaVerdictHdr     = 2
	nfqaCfgCmd         = 1
	nfqaCfgParams      = 2
	nfqaCfgQueueMaxlen = 3
	nfqaCfgMask        = 4
	nfqaCfgFlags       = 5
	nfqnlCfgCmdBind    = 1
	nfqnlCfgCmdUnbind  = 2
	nfqnlCopyMeta      = 1
	nfqaCfgFFailOpen   = 1
	nfAccept           = 1
)

// queue is one NFQUEUE this process reads and gives verdicts on.
type queue struct {
	fd            int
	num           uint16
	delay, jitter time.Duration
	sendMu        sync.Mutex
	seq           atomic.Uint32
	held          atomic.Int64 // packets waiting for their verdict
	closing       atomic.Bool
	done          chan struct{}
	firstErr      atomic.Pointer[error]
}

// openQueue opens a netlink socket inside the namespace and binds queue
// num to it.
func (n *Namespace) openQueue(num uint16) (*queue, error) {
	n.mu.Lock()
	nsfd, closed := n.fd, n.closed
	n.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("netns: queue on %s: the namespace is closed", n.name)
	}
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// As DialContext: the thread joins the namespace and ends with
		// this goroutine; the socket stays in the namespace.
		runtime.LockOSThread()
		if err := unix.Setns(nsfd, unix.CLONE_NEWNET); err != nil {
			ch <- result{-1, fmt.Errorf("netns: join %s: %w", n.name, err)}
			return
		}
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		ch <- result{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		return nil, fmt.Errorf("netns: netlink socket in %s: %w", n.name, r.err)
	}
	q := &queue{fd: r.fd, num: num, done: make(chan struct{})}
	fail := func(err error) (*queue, error) {
		_ = unix.Close(q.fd)
		return nil, fmt.Errorf("netns: NFQUEUE %d in %s: %w", num, n.name, err)
	}
	if err := unix.Bind(q.fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fail(err)
	}
	// Room for every packet of a busy link held for the whole delay.
	_ = unix.SetsockoptInt(q.fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20)
	if err := unix.SetsockoptTimeval(q.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 100_000}); err != nil {
		return fail(err)
	}
	cmd := []byte{nfqnlCfgCmdBind, 0, 0, 0} // command, pad, pf (unused since Linux 3.8)
	params := binary.BigEndian.AppendUint32(nil, 0xffff)
	params = append(params, nfqnlCopyMeta)
	attrs := attr(nil, nfqaCfgCmd, cmd)
	attrs = attr(attrs, nfqaCfgParams, params)
	attrs = attr(attrs, nfqaCfgQueueMaxlen, binary.BigEndian.AppendUint32(nil, 1<<16))
	attrs = attr(attrs, nfqaCfgMask, binary.BigEndian.AppendUint32(nil, nfqaCfgFFailOpen))
	attrs = attr(attrs, nfqaCfgFlags, binary.BigEndian.AppendUint32(nil, nfqaCfgFFailOpen))
	if err := q.request(nfqnlMsgConfig, attrs); err != nil {
		return fail(err)
	}
	return q, nil
}

// attr appends a netlink attribute, padded to 4 bytes.
func attr(b []byte, typ uint16, payload []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(4+len(payload)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, payload...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// message is a netlink message of the queue subsystem for q.
func (q *queue) message(msgType uint16, flags uint16, attrs []byte) []byte {
	b := make([]byte, 0, 20+len(attrs))
	b = binary.NativeEndian.AppendUint32(b, uint32(20+len(attrs)))
	b = binary.NativeEndian.AppendUint16(b, nfnlSubsysQueue<<8|msgType)
	b = binary.NativeEndian.AppendUint16(b, flags)
	b = binary.NativeEndian.AppendUint32(b, q.seq.Add(1))
	b = binary.NativeEndian.AppendUint32(b, 0)
	b = append(b, unix.AF_UNSPEC, 0) // nfgenmsg: family, version
	b = binary.BigEndian.AppendUint16(b, q.num)
	return append(b, attrs...)
}

func (q *queue) send(b []byte) error {
	q.sendMu.Lock()
	defer q.sendMu.Unlock()
	return unix.Sendto(q.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
}

// request sends a message and waits for the kernel's acknowledgement.
func (q *queue) request(msgType uint16, attrs []byte) error {
	if err := q.send(q.message(msgType, unix.NLM_F_REQUEST|unix.NLM_F_ACK, attrs)); err != nil {
		return err
	}
	buf := make([]byte, 1<<16)
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		nr, _, err := unix.Recvfrom(q.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:nr])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Type == unix.NLMSG_ERROR && len(m.Data) >= 4 {
				if code := int32(binary.NativeEndian.Uint32(m.Data)); code != 0 {
					return unix.Errno(-code)
				}
				return nil
			}
		}
	}
	return errors.New("no acknowledgement from the kernel within 2s")
}

// serve reads queued packets and accepts each after its delay, until
// stop.
func (q *queue) serve() {
	defer close(q.done)
	buf := make([]byte, 1<<16)
	for !q.closing.Load() {
		nr, _, err := unix.Recvfrom(q.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			// ENOBUFS: notifications were lost; their packets stay queued
			// until the queue is unbound, which drops them (loss).
			q.setErr(fmt.Errorf("netns: NFQUEUE %d: %w", q.num, err))
			if errors.Is(err, unix.ENOBUFS) {
				continue
			}
			return
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:nr])
		if err != nil {
			q.setErr(err)
			continue
		}
		for _, m := range msgs {
			if m.Header.Type != nfnlSubsysQueue<<8|nfqnlMsgPacket || len(m.Data) < 4 {
				continue
			}
			id, ok := packetID(m.Data[4:])
			if !ok {
				continue
			}
			d := q.delay
			if q.jitter > 0 {
				d += time.Duration(rand.Int64N(int64(2*q.jitter)+1)) - q.jitter
			}
			q.held.Add(1)
			time.AfterFunc(d, func() {
				defer q.held.Add(-1)
				q.verdict(id)
			})
		}
	}
}

func (q *queue) verdict(id uint32) {
	hdr := binary.BigEndian.AppendUint32(nil, nfAccept)
	hdr = binary.BigEndian.AppendUint32(hdr, id)
	if err := q.send(q.message(nfqnlMsgVerdict, unix.NLM_F_REQUEST, attr(nil, nfqaVerdictHdr, hdr))); err != nil {
		q.setErr(fmt.Errorf("netns: NFQUEUE %d verdict: %w", q.num, err))
	}
}

// packetID finds NFQA_PACKET_HDR's packet id among a packet message's
// attributes.
func packetID(b []byte) (uint32, bool) {
	for len(b) >= 4 {
		l := int(binary.NativeEndian.Uint16(b))
		typ := binary.NativeEndian.Uint16(b[2:]) & 0x3fff // without the nested and byte-order flags
		if l < 4 || l > len(b) {
			return 0, false
		}
		if typ == nfqaPacketHdr && l >= 8 {
			return binary.BigEndian.Uint32(b[4:]), true
		}
		b = b[min((l+3)&^3, len(b)):]
	}
	return 0, false
}

func (q *queue) setErr(err error) { q.firstErr.CompareAndSwap(nil, &err) }

func (q *queue) err() error {
	if p := q.firstErr.Load(); p != nil {
		return *p
	}
	return nil
}

// stop waits up to wait for the held packets' verdicts, then unbinds the
// queue and closes the socket.
func (q *queue) stop(wait time.Duration) {
	deadline := time.Now().Add(wait + time.Second)
	for q.held.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	q.closing.Store(true)
	<-q.done
	_ = q.request(nfqnlMsgConfig, attr(nil, nfqaCfgCmd, []byte{nfqnlCfgCmdUnbind, 0, 0, 0}))
	_ = unix.Close(q.fd)
}
