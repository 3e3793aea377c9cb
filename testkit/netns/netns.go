package netns

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// namePrefix starts every namespace this package creates, followed by the
// creating process's pid, so that a later run can remove what a killed
// one left behind.
const namePrefix = "caughtup-"

// subnet is where each namespace's link takes a /30: 10.231.k.0/30, host
// side .1, namespace side .2.
const subnet = "10.231."

// Direction says which packets Block drops.
type Direction int

const (
	// Out drops what the namespace sends to the port: requests never
	// arrive.
	Out Direction = 1 << iota
	// In drops what comes back from the port: requests arrive, answers
	// do not.
	In
	// Both drops either way.
	Both = Out | In
)

func (d Direction) String() string {
	switch d {
	case Out:
		return "out"
	case In:
		return "in"
	case Both:
		return "both ways"
	}
	return "direction(" + strconv.Itoa(int(d)) + ")"
}

// Namespace is one network namespace with a veth link to the root
// namespace. Its methods are safe for concurrent use.
type Namespace struct {
	name     string // ip netns name
	hostIf   string // the link's root side
	k        int    // 10.231.k.0/30
	hostIP   string
	ip       string
	fd       int // /run/netns/<name>, open for setns
	mu       sync.Mutex
	closed   bool
	rootNAT  string // nft table in the root namespace
	nsFilter string // nft table inside
	queues   int    // NFQUEUEs opened (Delay)
}

// Check reports whether this host can create namespaces: root, iproute2
// and nftables present. The error says what is missing.
func Check() error {
	if os.Geteuid() != 0 {
		return errors.New("netns: network namespaces need root (ip netns add); this process runs as uid " + strconv.Itoa(os.Geteuid()))
	}
	for _, tool := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("netns: %s is not installed (Debian: apt-get install iproute2 nftables): %w", tool, err)
		}
	}
	return nil
}

var (
	createMu sync.Mutex
	swept    sync.Once
)

// New creates a namespace for role (a short word: "worker", "pub"), its
// link and the root side's address mapping. Close removes them.
func New(role string) (*Namespace, error) {
	if err := Check(); err != nil {
		return nil, err
	}
	createMu.Lock()
	defer createMu.Unlock()
	swept.Do(sweep)
	name := fmt.Sprintf("%s%d-%s", namePrefix, os.Getpid(), role)
	if _, err := os.Stat("/run/netns/" + name); err == nil {
		return nil, fmt.Errorf("netns: namespace %s exists already (one Namespace per role and process)", name)
	}
	k, err := freeSubnet()
	if err != nil {
		return nil, err
	}
	n := &Namespace{
		name:     name,
		hostIf:   hostLink(k),
		k:        k,
		hostIP:   fmt.Sprintf("%s%d.1", subnet, k),
		ip:       fmt.Sprintf("%s%d.2", subnet, k),
		fd:       -1,
		rootNAT:  natTable(k),
		nsFilter: "caughtup_faults",
	}
	nsIf := fmt.Sprintf("cu%dn", k)
	ok := false
	defer func() {
		if !ok {
			_ = n.Close()
		}
	}()
	steps := [][]string{
		{"ip", "netns", "add", name},
		{"ip", "link", "add", n.hostIf, "type", "veth", "peer", "name", nsIf},
		{"ip", "link", "set", nsIf, "netns", name},
		{"ip", "addr", "add", n.hostIP + "/30", "dev", n.hostIf},
		{"ip", "link", "set", n.hostIf, "up"},
		{"ip", "-n", name, "addr", "add", n.ip + "/30", "dev", nsIf},
		{"ip", "-n", name, "link", "set", nsIf, "up"},
		{"ip", "-n", name, "link", "set", "lo", "up"},
		{"ip", "-n", name, "route", "add", "default", "via", n.hostIP},
		// Packets to 127.0.0.1 that arrive on the link are not martians.
		{"sysctl", "-qw", "net.ipv4.conf." + n.hostIf + ".route_localnet=1"},
	}
	for _, s := range steps {
		if err := run(nil, s...); err != nil {
			return nil, err
		}
	}
	root := fmt.Sprintf(`table ip %[1]s {
	chain pre { type nat hook prerouting priority -100; iifname %[2]q ip daddr %[3]s dnat to 127.0.0.1; }
	chain in { type nat hook input priority 100; iifname %[2]q snat to 127.0.0.1; }
}
`, n.rootNAT, n.hostIf, n.hostIP)
	if err := run([]byte(root), "nft", "-f", "-"); err != nil {
		return nil, err
	}
	inside := fmt.Sprintf(`table ip %[1]s {
	set out { type inet_service; }
	set in { type inet_service; }
	chain output { type filter hook output priority 0; ip daddr %[2]s tcp dport @out drop; }
	chain input { type filter hook input priority 0; ip saddr %[2]s tcp sport @in drop; }
}
`, n.nsFilter, n.hostIP)
	if err := run([]byte(inside), "ip", "netns", "exec", name, "nft", "-f", "-"); err != nil {
		return nil, err
	}
	fd, err := unix.Open("/run/netns/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("netns: open /run/netns/%s: %w", name, err)
	}
	n.fd = fd
	ok = true
	return n, nil
}

// Name is the namespace's name, for `ip netns exec`.
func (n *Namespace) Name() string { return n.name }

// HostIP is the root side's address of the link, which reaches the root
// namespace's 127.0.0.1 from inside.
func (n *Namespace) HostIP() string { return n.hostIP }

// Addr rewrites a root-namespace loopback address (127.0.0.1:port,
// localhost:port) to the one that reaches it from inside the namespace;
// any other address, and URLs and DSNs, have their loopback host
// rewritten the same way.
func (n *Namespace) Addr(addr string) string {
	return loopback.ReplaceAllString(addr, "${1}"+n.hostIP+"${2}")
}

var loopback = regexp.MustCompile(`(^|[@/,=\s])(?:127\.0\.0\.1|localhost)(:\d+)`)

// DialContext dials addr from inside the namespace (addr as Addr rewrites
// it). The connection stays in the namespace whatever thread uses it.
func (n *Namespace) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	n.mu.Lock()
	fd, closed := n.fd, n.closed
	n.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("netns: dial %s from %s: the namespace is closed", addr, n.name)
	}
	addr = n.Addr(addr)
	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// The thread joins the namespace and is never handed back: a
		// goroutine that ends locked takes its thread with it, so no
		// other goroutine ever runs in the namespace by accident.
		runtime.LockOSThread()
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			ch <- result{err: fmt.Errorf("netns: join %s: %w", n.name, err)}
			return
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		ch <- result{c, err}
	}()
	r := <-ch
	return r.c, r.err
}

// Command is name run inside the namespace (ip netns exec, which keeps the
// pid: signals reach the program itself).
func (n *Namespace) Command(name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", n.name, name}, args...)...)
}

// Block drops the namespace's packets to (Out) or from (In) the root
// namespace's port, or both, until heal is called. Connections already
// open hang as well as new ones: nothing is refused or reset.
func (n *Namespace) Block(port int, d Direction) (heal func() error, err error) {
	var sets []string
	if d&Out != 0 {
		sets = append(sets, "out")
	}
	if d&In != 0 {
		sets = append(sets, "in")
	}
	if len(sets) == 0 {
		return nil, fmt.Errorf("netns: block port %d: no direction", port)
	}
	for _, s := range sets {
		if err := n.nft("add", "element", "ip", n.nsFilter, s, "{", strconv.Itoa(port), "}"); err != nil {
			return nil, err
		}
	}
	var once sync.Once
	return func() error {
		var err error
		once.Do(func() {
			for _, s := range sets {
				err = errors.Join(err, n.nft("delete", "element", "ip", n.nsFilter, s, "{", strconv.Itoa(port), "}"))
			}
		})
		return err
	}, nil
}

// Lose drops percent of the packets between the namespace and the root
// namespace's port, each way, at random, until heal is called.
func (n *Namespace) Lose(port int, percent int) (heal func() error, err error) {
	if percent < 1 || percent > 100 {
		return nil, fmt.Errorf("netns: loss of %d%%: want 1 to 100", percent)
	}
	chain := fmt.Sprintf("loss_%d", port)
	rules := fmt.Sprintf(`table ip %[1]s {
	chain %[2]s_out { type filter hook output priority 10; ip daddr %[3]s tcp dport %[4]d numgen random mod 100 <= %[5]d drop; }
	chain %[2]s_in { type filter hook input priority 10; ip saddr %[3]s tcp sport %[4]d numgen random mod 100 <= %[5]d drop; }
}
`, n.nsFilter, chain, n.hostIP, port, percent-1)
	if err := run([]byte(rules), "ip", "netns", "exec", n.name, "nft", "-f", "-"); err != nil {
		return nil, err
	}
	var once sync.Once
	return func() error {
		var err error
		once.Do(func() {
			err = errors.Join(n.nft("delete", "chain", "ip", n.nsFilter, chain+"_out"),
				n.nft("delete", "chain", "ip", n.nsFilter, chain+"_in"))
		})
		return err
	}, nil
}

// Heal removes every Block and Lose at once.
func (n *Namespace) Heal() error {
	var script bytes.Buffer
	fmt.Fprintf(&script, "flush set ip %[1]s out\nflush set ip %[1]s in\n", n.nsFilter)
	out, err := exec.Command("ip", "netns", "exec", n.name, "nft", "-a", "list", "table", "ip", n.nsFilter).Output()
	if err != nil {
		return fmt.Errorf("netns: list %s's rules: %w", n.name, err)
	}
	for _, m := range lossChain.FindAllStringSubmatch(string(out), -1) {
		fmt.Fprintf(&script, "delete chain ip %s %s\n", n.nsFilter, m[1])
	}
	return run(script.Bytes(), "ip", "netns", "exec", n.name, "nft", "-f", "-")
}

var lossChain = regexp.MustCompile(`chain (loss_\d+_(?:out|in)) \{`)

func (n *Namespace) nft(args ...string) error {
	return run(nil, append([]string{"ip", "netns", "exec", n.name, "nft"}, args...)...)
}

// Close removes the namespace (and with it the link) and the root side's
// mapping.
func (n *Namespace) Close() error {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil
	}
	n.closed = true
	fd := n.fd
	n.fd = -1
	n.mu.Unlock()
	if fd >= 0 {
		_ = unix.Close(fd)
	}
	return remove(n.name, n.rootNAT, n.hostIf)
}

func remove(name, table, hostIf string) error {
	var errs []error
	if table != "" && exec.Command("nft", "list", "table", "ip", table).Run() == nil {
		errs = append(errs, run(nil, "nft", "delete", "table", "ip", table))
	}
	if _, err := os.Stat("/run/netns/" + name); err == nil {
		errs = append(errs, run(nil, "ip", "netns", "del", name))
	}
	// The veth pair goes with the namespace; a link whose peer never
	// moved in does not.
	// The kernel removes a namespace, and its links, once the last
	// reference goes: the link may vanish between the look and the
	// delete.
	if hostIf != "" && exec.Command("ip", "link", "show", hostIf).Run() == nil {
		if err := run(nil, "ip", "link", "del", hostIf); err != nil && !strings.Contains(err.Error(), "Cannot find device") {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// sweep removes namespaces (with their links and mappings) that processes
// no longer running left behind.
func sweep() {
	entries, err := os.ReadDir("/run/netns")
	if err != nil {
		return
	}
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), namePrefix)
		if !ok {
			continue
		}
		pidText, _, _ := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidText)
		if err != nil || pid == os.Getpid() || syscall.Kill(pid, 0) == nil {
			continue
		}
		k := linkSubnet(e.Name())
		table, hostIf := "", ""
		if k > 0 {
			table, hostIf = natTable(k), hostLink(k)
		}
		_ = remove(e.Name(), table, hostIf)
	}
}

var nsAddr = regexp.MustCompile(`inet 10\.231\.(\d+)\.2/30`)

// linkSubnet is the k of the namespace's 10.231.k.2 address, 0 if none.
func linkSubnet(name string) int {
	out, err := exec.Command("ip", "-n", name, "-o", "-4", "addr", "show").Output()
	if err != nil {
		return 0
	}
	m := nsAddr.FindSubmatch(out)
	if m == nil {
		return 0
	}
	k, _ := strconv.Atoi(string(m[1]))
	return k
}

// hostLink and natTable name the root side's link and address mapping of
// the namespace on 10.231.k.0/30.
func hostLink(k int) string { return fmt.Sprintf("cu%dh", k) }
func natTable(k int) string { return fmt.Sprintf("caughtup_netns_%d", k) }

// freeSubnet is a k whose 10.231.k.0/30 no link in the root namespace
// uses.
func freeSubnet() (int, error) {
	out, err := exec.Command("ip", "-o", "-4", "addr", "show").Output()
	if err != nil {
		return 0, fmt.Errorf("netns: ip addr show: %w", err)
	}
	for k := 1; k < 255; k++ {
		if !bytes.Contains(out, []byte(fmt.Sprintf(" %s%d.1/30 ", subnet, k))) &&
			exec.Command("ip", "link", "show", hostLink(k)).Run() != nil {
			return k, nil
		}
	}
	return 0, errors.New("netns: every 10.231.k.0/30 link is in use")
}

// run runs a command, with stdin if given, and returns its output in the
// error.
func run(stdin []byte, args ...string) error {
	cmd := exec.Command(args[0], args[1:]...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("netns: %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}
