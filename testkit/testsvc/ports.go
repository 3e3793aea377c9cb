package testsvc

import (
	"errors"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// Ports come from below the kernel's ephemeral range, so that no outgoing
// connection (ours included: every client takes a local port) can be
// sitting on a port when its server starts or restarts. While a server is
// down its port stays reserved by a bound, non-listening socket: other
// binds fail, yet connecting gets ECONNREFUSED as from a dead server.

const lowestPort = 10000

var portRange struct {
	once   sync.Once
	lo, hi int // [lo, hi)
}

func candidatePorts() (lo, hi int) {
	portRange.once.Do(func() {
		portRange.lo, portRange.hi = lowestPort, 32768
		b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
		if err != nil {
			return
		}
		f := strings.Fields(string(b))
		if len(f) == 2 {
			eph, err := strconv.Atoi(f[0])
			if err == nil && eph-lowestPort >= 1000 {
				portRange.hi = eph
			} else if err == nil {
				// Ephemeral range starts too low to avoid; use what is above it.
				hi, _ := strconv.Atoi(f[1])
				portRange.lo, portRange.hi = hi+1, 65536
			}
		}
	})
	return portRange.lo, portRange.hi
}

// usedPorts keeps two servers of this process, of any harness, from picking
// the same port.
var usedPorts struct {
	sync.Mutex
	m map[int]bool
}

// PickPort returns a port and a socket holding it; release it with
// UnholdPort right before the server binds.
func PickPort() (port, fd int, err error) {
	lo, hi := candidatePorts()
	usedPorts.Lock()
	defer usedPorts.Unlock()
	if usedPorts.m == nil {
		usedPorts.m = map[int]bool{}
	}
	for range 200 {
		port := lo + rand.IntN(hi-lo)
		if usedPorts.m[port] {
			continue
		}
		fd, err := HoldPort(port)
		if err != nil {
			continue
		}
		usedPorts.m[port] = true
		return port, fd, nil
	}
	return 0, -1, errors.New("testsvc: no free loopback port found")
}

// HoldPort binds 127.0.0.1:port without SO_REUSEADDR and without listening.
func HoldPort(port int) (int, error) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		_ = syscall.Close(fd)
		return -1, err
	}
	return fd, nil
}

// UnholdPort closes the holding socket *fd, if any, and sets it to -1.
func UnholdPort(fd *int) {
	if *fd >= 0 {
		_ = syscall.Close(*fd)
		*fd = -1
	}
}
