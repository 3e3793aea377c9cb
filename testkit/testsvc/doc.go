// Package testsvc is what the service harnesses (testkit/pgtest for
// PostgreSQL and Redis, testkit/kafkatest for Kafka and Kafka Connect)
// share: temporary directories guarded by a watchdog, one signal handler
// for every running service, loopback ports, child processes whose exit
// is observed once, and the lifecycle of the services a test binary shares
// (Shared: started lazily, closed when TestMain's tests end).
//
// It is one package rather than a copy per harness because two of these
// must be process-wide to work: the set of ports handed out (two harnesses
// in one test binary must not pick the same port) and the SIGINT/SIGTERM
// handler (one handler closes every service, then re-raises the signal).
//
// # Cleanup
//
// Processes and temporary directories must not outlive the test binary, even
// when it is killed. Three layers make sure of that:
//
//  1. The harness's Close.
//  2. Register's SIGINT/SIGTERM handler, installed while anything is
//     registered, that closes everything and then re-raises the signal.
//  3. A watchdog per Sandbox: a detached `sh` (its own session, so Ctrl-C
//     and process-group kills miss it) that blocks reading a pipe whose only
//     writer is the test binary. The kernel closes that pipe when the test
//     binary dies for any reason, including SIGKILL and the panic of
//     `go test -timeout`; the watchdog then SIGKILLs every process whose
//     working directory is inside the sandbox, removes leftover SysV shared
//     memory of PostgreSQL servers and deletes the directory. Matching on the
//     working directory rather than on a PID list means restarts, children
//     and helper programs are all covered without bookkeeping, and a
//     recycled PID is never hit. A service therefore must run with its
//     working directory inside its sandbox.
package testsvc
