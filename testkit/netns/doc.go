// Package netns puts a test's clients behind a network link of their own,
// so that a fault drops packets instead of refusing connections: a
// partition as a real network makes it, where TCP hangs until a timeout
// rather than failing at once.
//
// A Namespace is a Linux network namespace joined to the root namespace by
// a veth pair. The servers the harnesses start (PostgreSQL, redis-server)
// listen on 127.0.0.1 in the root namespace and stay as they are: the
// root side maps the link's host address to 127.0.0.1 (DNAT, with
// route_localnet on the link) and rewrites the source to 127.0.0.1 too, so
// that loopback-only pg_hba rules and Redis's protected mode still hold.
// A client reaches them from inside the namespace in one of two ways:
//
//   - in process, with DialContext: the socket is created on a thread that
//     has joined the namespace, and it stays there for its life; pgx's
//     DialFunc and go-redis's Dialer take it as it is;
//   - as a child process, with Command (`ip netns exec`), handing it
//     addresses rewritten with Addr.
//
// Faults are rules inside the namespace, on the root's ports: Block drops
// packets one way or both (an asymmetric partition is one way), Lose
// drops a share of them at random, and Delay holds each for a while.
// Only the namespace's own traffic is touched; every other client of the
// same server is not.
//
//	ns, err := netns.New("worker")
//	defer ns.Close()
//	cfg.ConnConfig.DialFunc = ns.DialContext // a pgx pool inside it
//	heal, err := ns.Block(replicaPort, netns.Both)
//	...
//	heal()
//
// It needs root, iproute2 and nftables (and iptables for Delay); Check
// says which is missing, and New fails with the same message. Nothing
// here goes into the product: it is the chaos suite's and the tests'
// harness.
//
// Delay holds packets for a delay with jitter. tc netem is the usual tool
// for that, and the kernels of this project's machines are built without
// it (sch_netem): Delay queues the packets to this process instead
// (iptables-legacy's NFQUEUE target, read over netlink) and lets each go
// once its time has come; Lose uses nftables' random numbers.
package netns
